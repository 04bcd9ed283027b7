"""Step profiler traces and the communication-share report."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlcore.observe.profile_report import (
    analyze_events,
    analyze_trace,
    merge,
    subtract,
    verdict,
)
from rlcore.observe.profiler import StepProfiler


def test_interval_algebra():
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]


def _x(name, cat, ts, dur, pid=0, tid=7):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_gpu_timeline_partition():
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 100, pid=1, tid=1),
        _x("sm90_gemm_bf16", "kernel", 0, 40),
        _x("ncclDevKernel_AllGather_RING_LL", "kernel", 30, 20, tid=9),  # 10 us overlap with the gemm
        _x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 60, 10),
        _x("elementwise_kernel", "kernel", 65, 10),  # 5 us under the memcpy
    ]
    b = analyze_events(events)
    assert b.mode == "gpu" and b.window_us == 100
    assert b.us == {"communication": 20, "memcpy": 10, "compute": 35, "idle": 35}
    assert b.overlapped_us == 10 and b.share("communication") == pytest.approx(0.2)
    assert list(b.top_comm) == ["ncclDevKernel_AllGather_RING_LL"]


def test_largest_kernels_are_tallied_and_listed():
    from rlcore.observe.profile_report import format_breakdown

    events = [_x("ProfilerStep#1", "user_annotation", 0, 100, pid=1, tid=1),
              _x("gemm", "kernel", 0, 30), _x("softmax", "kernel", 30, 10), _x("gemm", "kernel", 40, 30),
              _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 70, 5)]
    b = analyze_events(events)
    assert b.top_kernels == {"gemm": [60.0, 2], "softmax": [10.0, 1], "Memcpy DtoD (Device -> Device)": [5.0, 1]}
    lines = format_breakdown(b, kernels=2)
    listed = lines[lines.index("  largest kernels and copies (total ms, calls, share of the window):") + 1:]
    assert len(listed) == 2 and listed[0].endswith("gemm") and "2x" in listed[0] and "60.0%" in listed[0]
    assert listed[1].endswith("softmax")
    assert not any("largest" in line for line in format_breakdown(b))  # off by default


def test_cpu_timeline_counts_gloo_threads_and_skips_step_annotations():
    events = [
        _x("ProfilerStep#3", "user_annotation", 0, 200),
        _x("aten::mm", "cpu_op", 0, 50),
        _x("aten::addmm", "cpu_op", 10, 20),  # nested: counted once
        _x("c10d::allreduce_", "cpu_op", 50, 5),
        _x("gloo:all_reduce", "user_annotation", 52, 48, tid=99),
        _x("aten::copy_", "cpu_op", 120, 30),
        _x("aten::broadcast_tensors", "cpu_op", 150, 10),  # a compute op despite its name
    ]
    b = analyze_events(events)
    assert b.mode == "cpu"
    assert b.us == {"communication": 50, "memcpy": 30, "compute": 60, "idle": 60}
    assert "gloo:all_reduce" in b.top_comm


def test_verdict_thresholds():
    assert verdict(0.05)[0] == "OK"
    assert verdict(0.15)[0] == "WARN"
    assert verdict(0.25)[0] == "INVESTIGATE"


def _work(x):
    for _ in range(3):
        x = torch.tanh(x @ x.T)[:, :16]
    return x


def test_step_profiler_writes_one_trace_after_warmup(tmp_path):
    prof = StepProfiler(True, 2, str(tmp_path), rank=3)
    for step in range(5, 10):
        prof.step_start(step)
        _work(torch.randn(32, 16))
        prof.step_end(step)
    prof.close()
    assert prof.paths == [str(tmp_path / "profile" / "rank3.steps6-7.pt.trace.json")]
    with open(prof.paths[0]) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert any(str(n).startswith("ProfilerStep#") for n in names) and "aten::mm" in names
    b = analyze_trace(prof.paths[0])
    assert b.mode == "cpu" and b.us["communication"] == 0 and b.us["compute"] > 0
    assert sum(b.us.values()) == pytest.approx(b.window_us)


def test_disabled_profiler_and_early_close(tmp_path):
    off = StepProfiler(False, 5, str(tmp_path))
    off.step_start(1)
    off.step_end(1)
    off.close()
    assert off.paths == [] and not (tmp_path / "profile").exists()
    short = StepProfiler(True, 5, str(tmp_path), rank=0)
    for step in (1, 2, 3):  # the run ends inside the recorded window: the partial trace is kept
        short.step_start(step)
        _work(torch.randn(8, 16))
        short.step_end(step)
    short.close()
    assert len(short.paths) == 1 and os.path.getsize(short.paths[0]) > 0


def test_idle_gaps_name_the_host_op_of_the_thread_that_ran_last():
    """Each idle stretch of the device is put down to the host's ops at its middle, on the thread whose
    innermost op began last (the launching thread, not an idle one); shorter stretches are left out."""
    from rlcore.observe.profile_report import format_gaps, idle_gaps, summarize_gaps

    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000, pid=1, tid=1),
        _x("rlcore.update.micro_batch", "user_annotation", 0, 1000, pid=1, tid=1),
        _x("aten::item", "cpu_op", 150, 500, pid=1, tid=1),
        _x("cudaStreamSynchronize", "cuda_runtime", 160, 480, pid=1, tid=1),
        _x("aten::copy_", "cpu_op", 790, 100, pid=1, tid=1),
        _x("autograd thread wait", "cpu_op", 0, 1000, pid=1, tid=2),  # began first: not the one named
        _x("gemm", "kernel", 0, 200), _x("gemm", "kernel", 700, 100),  # idle 200-700 (500 us), 800-850 (50 us)
        _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 850, 150),
    ]
    gaps, window = idle_gaps(events, min_us=100)
    assert window == [(0, 1000)]
    gap, = gaps
    assert (gap.start_us, gap.dur_us) == (200, 500)
    assert gap.host == ("rlcore.update.micro_batch", "aten::item", "cudaStreamSynchronize")
    assert [g.dur_us for g in idle_gaps(events, min_us=10)[0]] == [500, 50]
    assert idle_gaps(events, min_us=10)[0][1].host[-1] == "aten::copy_"
    summary = summarize_gaps(*idle_gaps(events, min_us=10))
    assert summary["idle_s"] == pytest.approx(550e-6) and summary["idle_frac"] == pytest.approx(0.55)
    assert [row["op"] for row in summary["by_host_op"]] == ["cudaStreamSynchronize", "aten::copy_"]
    lines = format_gaps(gaps, window, 3)
    assert "cudaStreamSynchronize" in lines[1] and "micro_batch > aten::item > cudaStreamSynchronize" in lines[-1]


def test_idle_gaps_over_a_named_range_and_through_the_command(tmp_path, capsys):
    from rlcore.observe.profile_report import idle_gaps

    events = [_x("bench.update", "user_annotation", 100, 300, pid=1, tid=1),
              _x("k", "kernel", 0, 150), _x("k", "kernel", 300, 50)]
    gaps, window = idle_gaps(events, window_name="bench.update", min_us=1)
    assert window == [(100, 400)] and [(g.start_us, g.dur_us) for g in gaps] == [(50, 150), (250, 50)]
    assert gaps[0].host == ("bench.update",)
    assert idle_gaps(events, window_name="missing") == ([], [])
    assert idle_gaps([_x("op", "cpu_op", 0, 10)]) == ([], [])  # a CPU trace: no device to be idle
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_x("ProfilerStep#1", "user_annotation", 0, 1000, pid=1, tid=1),
                                                _x("k", "kernel", 0, 100), _x("k", "kernel", 900, 100),
                                                _x("aten::nonzero", "cpu_op", 50, 900, pid=1, tid=1)]}))
    from rlcore.cli import main

    assert main(["profile-report", str(path), "--gaps", "3"]) == 0
    out = capsys.readouterr().out
    assert "idle stretches: 1, 0.8 ms (80.0% of the window)" in out and "aten::nonzero" in out
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 10, pid=1, tid=1)]}))
    assert main(["profile-report", str(cpu), "--gaps", "3"]) == 0
    assert "a CPU trace has no device timeline" in capsys.readouterr().out


def test_idle_gaps_within_every_range_of_a_name(tmp_path, capsys):
    """--within NAME: only the idle time inside the host ranges of that name counts (the updates of all the
    profiled steps, say), each range cut at its own edges, the share taken of their summed time."""
    from rlcore.cli import main
    from rlcore.observe.profile_report import idle_gaps, summarize_gaps

    events = [_x("ProfilerStep#1", "user_annotation", 0, 2000, pid=1, tid=1),
              _x("rlcore.update", "user_annotation", 100, 400, pid=1, tid=1),
              _x("rlcore.generate", "user_annotation", 600, 600, pid=1, tid=1),
              _x("rlcore.update", "user_annotation", 1300, 500, pid=1, tid=1),
              _x("k", "kernel", 0, 200), _x("k", "kernel", 350, 100),  # update 1: idle 200-350, 450-500
              _x("k", "kernel", 500, 900),  # busy through the generation and into update 2 (to 1400)
              _x("k", "kernel", 1600, 300)]  # update 2: idle 1400-1600
    gaps, ranges = idle_gaps(events, within="rlcore.update", min_us=10)
    assert ranges == [(100, 500), (1300, 1800)]
    assert [(g.start_us, g.dur_us) for g in gaps] == [(100, 150), (350, 50), (1300, 200)]
    summary = summarize_gaps(gaps, ranges)
    assert summary["ranges"] == 2 and summary["idle_frac"] == pytest.approx(400 / 900)
    from rlcore.observe.profile_report import busy_share

    assert busy_share(events, ranges) == pytest.approx(500 / 900) and busy_share(events, []) == 0.0
    assert idle_gaps(events, within="rlcore.generate", min_us=10)[0] == []
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert main(["profile-report", str(path), "--gaps", "2", "--within", "rlcore.update"]) == 0
    out = capsys.readouterr().out
    assert "idle stretches: 2, " in out and "(38.9% of 2 ranges named rlcore.update)" in out
    assert main(["profile-report", str(path), "--gaps", "2", "--within", "rlcore.nothing"]) == 0
    assert "no host range named rlcore.nothing" in capsys.readouterr().out
