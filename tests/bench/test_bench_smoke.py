"""Every benchmark script runs end to end in its smallest CPU setting and writes its results file,
so the commands in docs/benchmarks.md keep working (the numbers of these runs mean nothing)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "rollout": ["bench_rollout.py", "--tiny", "--out", "{out}"],
    "grpo_step": ["bench_grpo_step.py", "--tiny", "--systems", "rlcore", "--workdir", "{tmp}", "--out", "{out}"],
    "reward": ["bench_reward.py", "--tiny", "--out", "{out}"],
    "multiturn": ["bench_multiturn.py", "--shape", "tiny", "--device", "cpu", "--sequences", "4", "--budget", "32",
                  "--tool-ms", "5", "--obs-tokens", "4", "--repeats", "1", "--out", "{out}"],
    "reshard": ["bench_reshard.py", "--tiny", "--out", "{out}"],
    "checkpoint": ["bench_checkpoint.py", "--hidden", "64", "--layers", "2", "--vocab", "512", "--dir", "{tmp}",
                   "--json", "{out}"],
    "update": ["bench_update.py", "--samples", "8", "--prompt-len", "16", "--response-len", "16", "--micro", "2",
               "--repeats", "1", "--json", "{out}"],
    "update_fixed": ["bench_update.py", "--samples", "4", "--prompt-len", "8", "--response-len", "8", "--micro", "2",
                     "--repeats", "1", "--fixed", "--variants", "grouped,chunked", "--profile", "3", "--json", "{out}"],
    "data": ["bench_data.py", "all", "--dir", "{tmp}/data", "--shard-mib", "2", "--shards", "4", "--batches", "5",
             "--batch-size", "16", "--json", "{out}"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_script_runs(tmp_path, name):
    out = tmp_path / f"{name}.json"
    args = [a.format(out=out, tmp=tmp_path) for a in CASES[name]]
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", args[0]), *args[1:]], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    payload = json.loads(out.read_text())
    assert payload, f"{name}: empty results"


def test_kernel_sass_counts_the_attention_loop(tmp_path):
    """The static look at the attention kernel (no GPU needed): with a sub-block per warp the loop
    body has fewer barriers than with one softmax state for the block, as docs/rollout.md says."""
    pytest.importorskip("triton")
    out = tmp_path / "sass.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernel_sass.py"), "--settings",
                           '[{}, {"subblocks": 4, "num_warps": 4}]', "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one, four = json.loads(out.read_text())["rows"]
    assert one["loop_instructions"] > 0 and one["loop_mma"] > 0 and one["registers"] > 0
    assert four["loop_barriers"] < one["loop_barriers"]
    # the key/value loads of the next blocks are issued as asynchronous copies (a pipelined loop)
    assert one["loop_async_copies"] > 0 and four["loop_async_copies"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("script", ["check_decode_attention.py", "bench_decode_parts.py", "probe_attention.py"])
def test_cuda_only_scripts_say_they_need_cuda(tmp_path, script):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script),
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "CUDA" in proc.stdout + proc.stderr
