"""On a CUDA machine: the demo trains on the GPU through the rollout engine, with the NVML monitor,
the profiler, the profile report and the plot. Skipped without CUDA (CPU paths are covered elsewhere)."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rlcore(*args, cwd=None, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "rlcore", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("gpu-demo"))
    rc, out = rlcore("train", "trainer.device=cuda", f"trainer.output_dir={run_dir}", "trainer.progress=false",
                     "trainer.enable_profiling=true", "trainer.profile_steps=2", "trainer.gpu_monitor_interval=0.1")
    return rc, out, run_dir


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_demo_learns_on_the_gpu(gpu_run):
    rc, out, run_dir = gpu_run
    assert rc == 0, out[-4000:]
    rows = _metrics(run_dir)
    summaries = [r for r in rows if "after/reward_mean" in r]
    assert summaries, f"no summary in metrics.jsonl: {rows[-1] if rows else None}"
    before, after = summaries[-1]["before/reward_mean"], summaries[-1]["after/reward_mean"]
    assert after - before > 0.3, f"held-out reward {before:.3f} -> {after:.3f}"


def test_gpu_monitor_reports_real_samples(gpu_run):
    _, out, run_dir = gpu_run
    util = [r for r in _metrics(run_dir) if "gpu/util_mean" in r]
    assert util, "no gpu/* metrics although a GPU and NVML are present"
    assert all(r["gpu/samples"] >= 1 for r in util)
    assert all(0.0 <= r["gpu/util_mean"] <= 100.0 for r in util)
    assert max(r["gpu/mem_used_gb_max"] for r in util) > 0.0


def test_profiler_trace_and_report(gpu_run):
    _, _, run_dir = gpu_run
    traces = glob.glob(os.path.join(run_dir, "profile", "rank0.steps*.pt.trace.json"))
    assert traces, os.listdir(run_dir)
    rc, out = rlcore("profile-report", *traces)
    assert rc == 0, out
    lowered = out.lower()
    for category in ("communication", "compute", "memcpy", "idle"):
        assert category in lowered, out


def test_plot_writes_a_png(gpu_run):
    pytest.importorskip("matplotlib")
    _, _, run_dir = gpu_run
    rc, out = rlcore("plot", run_dir)
    assert rc == 0, out
    pngs = glob.glob(os.path.join(run_dir, "*.png"))
    assert pngs and os.path.getsize(pngs[0]) > 10_000, out


def test_monitor_command_prints_live_utilization():
    rc, out = rlcore("monitor", "--interval", "0.2", "--count", "3")
    assert rc == 0, out
    assert "no GPU to monitor" not in out, out
    assert "watching gpu0=" in out and "mean " in out and "%" in out, out
