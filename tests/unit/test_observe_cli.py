"""``rlcore monitor``, ``rlcore profile-report`` and ``rlcore plot`` through the CLI entry point."""

from __future__ import annotations

import json
import re

import pytest

from rlcore.observe import gpu
from rlcore.testing import run_cli


def test_monitor_without_gpu_exits_cleanly(monkeypatch):
    monkeypatch.setattr(gpu, "open_reader", lambda devices=None: (None, "NVML is not usable here (test)"))
    code, out, _ = run_cli(["monitor", "--interval", "0.01", "--count", "2"])
    assert code == 0 and "no GPU to monitor" in out
    code, _, err = run_cli(["monitor", "--interval", "0"])
    assert code == 2 and "--interval must be > 0" in err


def _trace(path, comm_us):
    events = [{"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0, "dur": 100, "pid": 0,
               "tid": 1},
              {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 0, "dur": 100 - comm_us, "pid": 0, "tid": 7},
              {"ph": "X", "name": "ncclDevKernel_AllReduce", "cat": "kernel", "ts": 100 - comm_us, "dur": comm_us,
               "pid": 0, "tid": 8}]
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


@pytest.mark.parametrize("comm,level,code", [(5, "OK", 0), (15, "WARN", 0), (30, "INVESTIGATE", 1)])
def test_profile_report_flags_communication(tmp_path, comm, level, code):
    path = _trace(tmp_path / "rank0.pt.trace.json", comm)
    rc, out, _ = run_cli(["profile-report", path, "--strict"])
    assert rc == code and f"{level}:" in out
    assert re.search(rf"communication +{comm:.1f}%", out)


def test_profile_report_reads_a_run_directory_and_sums_ranks(tmp_path):
    (tmp_path / "profile").mkdir()
    _trace(tmp_path / "profile" / "rank0.json", 10)
    _trace(tmp_path / "profile" / "rank1.json", 30)
    rc, out, _ = run_cli(["profile-report", str(tmp_path)])
    assert rc == 0 and "all 2 traces" in out
    assert re.search(r"all 2 traces.*\n  communication +20\.0%", out)
    rc, _, err = run_cli(["profile-report", str(tmp_path / "missing.json")])
    assert rc == 2 and "no such trace" in err


def test_plot_command(tmp_path):
    pytest.importorskip("matplotlib")
    from rlcore.observe.jsonl import JsonlWriter, make_record

    w = JsonlWriter(str(tmp_path / "metrics.jsonl"))
    for s in (1, 2):
        w.write(make_record(s, {"reward/mean": 0.1 * s, "time/step_s": 0.2}, "train"))
    w.close()
    rc, out, _ = run_cli(["plot", str(tmp_path)])
    assert rc == 0 and (tmp_path / "dashboard.png").is_file() and "dashboard.png" in out


def test_a_full_disk_while_drawing_the_dashboard_is_a_warning_of_the_summary(tmp_path, monkeypatch, caplog):
    pytest.importorskip("matplotlib")
    import errno
    import os

    from matplotlib.figure import Figure

    from rlcore.cli import print_summary
    from rlcore.observe.jsonl import JsonlWriter, make_record

    w = JsonlWriter(str(tmp_path / "metrics.jsonl"))
    w.write(make_record(1, {"reward/mean": 0.1, "time/step_s": 0.2}, "train"))
    w.close()

    def savefig(self, path, **kw):  # the disk fills half-way through the PNG
        with open(path, "wb") as f:
            f.write(b"\x89PNG")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", savefig)
    print_summary({}, str(tmp_path))  # the end of a completed run: must not raise
    assert "could not be written" in caplog.text
    assert not list(tmp_path.glob("dashboard*")), "a torn dashboard was left behind"
