"""Console line, JSONL records and the plot dashboard."""

from __future__ import annotations

import json
import logging

import pytest

from rlcore.errors import RLCoreError
from rlcore.observe.console import format_metrics, print_metrics
from rlcore.observe.jsonl import JsonlWriter, make_record, read_jsonl


def test_console_line_ends_with_the_step_time_in_ms(caplog):
    line = format_metrics(7, {"reward/mean": 0.5, "other": 1.0, "time/step_s": 1.2345}, "train")
    assert line == "[train] step 7: reward/mean=0.5 | step 7 took 1234ms"
    assert line.split()[-1] == "1234ms"
    val = format_metrics(7, {"b": 2.0, "a": 1}, "val")
    assert val == "[val] step 7: a=1 b=2"
    with caplog.at_level(logging.INFO, logger="rlcore.metrics"):
        print_metrics(3, {"kl/mean": 0.01, "time/step_s": 0.5}, "train")
    assert "step 3 took 500ms" in caplog.text


def test_jsonl_is_strict_and_tolerates_a_torn_last_line(tmp_path):
    import torch

    path = tmp_path / "m.jsonl"
    w = JsonlWriter(str(path))
    w.write(make_record(1, {"x": float("nan"), "t": torch.tensor(2.5), "n": 3}, "train"))
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write({})
    with open(path, "a") as f:
        f.write('{"step": 2, "spl')
    records = list(read_jsonl(str(path)))
    assert len(records) == 1 and records[0]["x"] is None and records[0]["t"] == 2.5 and records[0]["n"] == 3
    json.loads(path.read_text().splitlines()[0])


def _write_run(run_dir, steps=6):
    w = JsonlWriter(str(run_dir / "metrics.jsonl"))
    for s in range(1, steps + 1):
        w.write(make_record(s, {"reward/mean": s / 10, "reward/min": 0.0, "reward/max": s / 5, "kl/mean": 0.01 * s,
                                "response/length_mean": 5.0, "response/length_max": 6.0, "response/clip_frac": 0.1,
                                "time/generate_s": 0.3, "time/update_actor_s": 0.2, "time/step_s": 0.6,
                                "gpu/util_mean": 88.0, "gpu/util_p10": 75.0, "perf/tokens_per_s": 1000.0,
                                "perf/mfu": 0.3}, "train"))
    w.write(make_record(3, {"reward/mean": 9.9}, "train"))  # a resumed run rewrote step 3
    w.write(make_record(steps, {"reward_mean": 0.5}, "val"))
    w.close()


def test_plot_dashboard(tmp_path):
    pytest.importorskip("matplotlib")
    from rlcore.observe.plot import load_metrics, plot_run

    _write_run(tmp_path)
    train, val = load_metrics(str(tmp_path))
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and train[2]["reward/mean"] == 9.9 and len(val) == 1
    path = plot_run(str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_errors_are_clear(tmp_path, monkeypatch):
    from rlcore.observe import plot

    with pytest.raises(RLCoreError, match="no metrics.jsonl"):
        plot.plot_run(str(tmp_path))
    _write_run(tmp_path)
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(RLCoreError, match="needs matplotlib: pip install matplotlib"):
        plot.plot_run(str(tmp_path))
