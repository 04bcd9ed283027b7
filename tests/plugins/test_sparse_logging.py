"""The sparse-logging plugin: JSONL, console line for the seed's grep, quiet default console, per-run state."""

from __future__ import annotations

import io
import json
import logging
import subprocess

import pytest

import rlcore.plugins.sparse_logging as sparse
from rlcore.observe.console import LOGGER_NAME
from rlcore.protocols import DistInfo


def _metrics(ms):
    return {"reward/mean": 0.25, "kl/mean": 0.001, "time/step_s": ms / 1000, "time/generate_s": 0.5,
            "perf/mfu": float("nan")}


def test_hooks_write_jsonl_console_and_restore_the_default_console(tmp_path, capsys):
    from rlcore.plugin_manager import build_plugin_manager

    console = logging.getLogger(LOGGER_NAME)
    before = console.level
    pm = build_plugin_manager(["sparse-logging"])  # with the built-in metrics-file plugin, which writes the JSONL
    plugin = pm.get_plugin("sparse-logging")
    assert isinstance(plugin, sparse.SparseLoggingPlugin) and build_plugin_manager(["sparse-logging"]).get_plugin(
        "sparse-logging") is not plugin  # per-run state lives on an instance per plugin manager
    pm.hook.rlcore_train_start(run_dir=str(tmp_path), dist=DistInfo(), config={"trainer": {"resume": "disable"}})
    assert console.level == logging.WARNING  # the default line is quiet while the plugin prints
    pm.hook.rlcore_metrics(step=10, metrics=_metrics(1142), split="train")
    pm.hook.rlcore_metrics(step=20, metrics=_metrics(987.4), split="train")
    pm.hook.rlcore_metrics(step=20, metrics={"reward_mean": 0.5}, split="val")
    pm.hook.rlcore_train_end(step=20, status="completed", summary={"after/reward_mean": 0.5})
    assert console.level == before and plugin.current is None
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records] == [(10, "train"), (20, "train"), (20, "val"), (20, "summary")]
    assert records[0]["reward/mean"] == 0.25 and records[0]["perf/mfu"] is None  # strict JSON
    assert records[-1]["status"] == "completed"
    out = capsys.readouterr().out
    log = tmp_path / "train.log"
    log.write_text("noise line\n" + out)
    cmd = f"grep 'step.*took' {log} | awk '{{print $NF}}' | sed 's/ms//g'"
    assert subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.split() == ["1142", "987"]


def test_non_main_rank_writes_nothing(tmp_path):
    logger = sparse.SparseLogger(str(tmp_path), is_main=False)
    logger.metrics(1, _metrics(5), "train")
    logger.close(1, "completed", {})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_each_run_gets_fresh_state_and_appends_on_resume(tmp_path):
    from rlcore.plugins.metrics_file import JsonlSink

    stream = io.StringIO()
    for step in (1, 2):
        logger = sparse.SparseLogger(str(tmp_path), tensorboard=False, stream=stream)
        record = JsonlSink(str(tmp_path / "metrics.jsonl"))
        for sink in (logger, record):
            sink.metrics(step, _metrics(10), "train")
            sink.close(step, "interrupted", {})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 1, 2, 2]
    assert stream.getvalue().count("took 10ms") == 2


def test_tensorboard_scalars_through_a_writer(tmp_path):
    from rlcore.observe.tensorboard import TensorBoardSink

    class Writer:
        def __init__(self):
            self.scalars, self.closed = [], False

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            self.closed = True

    w = Writer()
    sink = TensorBoardSink(str(tmp_path), writer=w)
    sink.write(3, {"a": 1.0, "b": float("inf"), "c": "text", "d": True}, "train")
    sink.write(3, {"reward_mean": 0.5}, "val")
    sink.close()
    assert w.scalars == [("a", 1.0, 3), ("val/reward_mean", 0.5, 3)] and w.closed


def test_real_tensorboard_when_installed(tmp_path):
    pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is not installed")
    logger = sparse.SparseLogger(str(tmp_path), stream=io.StringIO())
    logger.metrics(1, _metrics(10), "train")
    logger.close(1, "completed", {})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25)]
    assert "perf/mfu" not in events.Tags()["scalars"]  # NaN is not written


def test_plugin_loads_by_name():
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(["sparse-logging"])
    assert "sparse-logging" in [i.name for i in pm.infos()]


def test_sink_hooks_close_a_stale_sink_and_build_a_new_one_per_run():
    from rlcore.observe.sink import SinkHooks

    events = []

    class Sink:
        def __init__(self, name):
            self.name = name

        def metrics(self, step, metrics, split):
            events.append((self.name, "metrics", step))

        def close(self, step, status, summary):
            events.append((self.name, status, step))

    runs = iter(["first", "second"])
    start, record, end = SinkHooks(lambda run_dir, dist, config: Sink(next(runs))).hooks()
    start(run_dir="r", dist=DistInfo(), config={})
    record(step=1, metrics={}, split="train")
    start(run_dir="r", dist=DistInfo(), config={})  # the first run never ended
    record(step=2, metrics={}, split="train")
    end(step=2, status="completed", summary={})
    record(step=3, metrics={}, split="train")  # after the end: dropped
    assert events == [("first", "metrics", 1), ("first", "failed", 0), ("second", "metrics", 2),
                      ("second", "completed", 2)]


def test_a_run_that_does_not_resume_starts_its_metrics_file_anew(tmp_path):
    import json

    from rlcore.plugins.metrics_file import MetricsFilePlugin
    from rlcore.protocols import DistInfo

    plugin = MetricsFilePlugin()
    for resume, expected in (("auto", 2), ("disable", 1)):
        for _ in range(2 if resume == "auto" else 1):
            plugin.rlcore_train_start(run_dir=str(tmp_path), dist=DistInfo(), config={"trainer": {"resume": resume}})
            plugin.rlcore_metrics(step=1, metrics={"reward/mean": 0.5}, split="train")
            plugin.rlcore_train_end(step=1, status="completed", summary={})
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert sum(1 for x in lines if x["split"] == "train") == expected, resume
