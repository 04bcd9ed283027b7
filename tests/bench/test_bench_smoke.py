"""Every benchmark script runs end to end in its smallest CPU setting and writes its results file,
so the commands in docs/benchmarks.md keep working (the numbers of these runs mean nothing)."""

import dataclasses
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
    "long_rollout": ["bench_long_rollout.py", "--tiny", "--out", "{out}"],
    "grpo_step": ["bench_grpo_step.py", "--tiny", "--systems", "rlcore", "--workdir", "{tmp}", "--out", "{out}"],
    "lora": ["bench_lora.py", "--tiny", "--rank", "4", "--configs", "lora-7b-r4", "--workdir", "{tmp}", "--out",
             "{out}"],
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
    "update_varlen": ["bench_update.py", "--samples", "6", "--prompt-len", "8", "--response-len", "12", "--micro", "2",
                      "--repeats", "1", "--max-tokens", "40", "--variants", "grouped,budget,packed,packed-budget",
                      "--json", "{out}"],
    "update_pointwise": ["bench_update.py", "--samples", "4", "--prompt-len", "8", "--response-len", "8", "--micro", "2",
                         "--repeats", "1", "--variants", "compiled,compiled+pointwise", "--json", "{out}"],
    "stream_reward": ["bench_stream_reward.py", "--tiny", "--prompts", "2", "--n", "2", "--max-new-tokens", "12",
                      "--reward-ms", "1", "--repeats", "1", "--out", "{out}"],
    "mismatch": ["bench_mismatch.py", "--tiny", "--prompts", "2", "--max-new-tokens", "8", "--out", "{out}"],
    "async": ["bench_async.py", "--nproc", "2", "--steps", "3", "--warmup", "1", "--gen-ms", "20", "--train-ms", "20",
              "--staleness", "0,1", "--out", "{out}"],
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
                           '[{}, {"subblocks": 4, "num_warps": 4}, {"page_size": 64}]', "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one, four, paged = json.loads(out.read_text())["rows"]
    assert one["loop_instructions"] > 0 and one["loop_mma"] > 0 and one["registers"] > 0
    assert four["loop_barriers"] < one["loop_barriers"]
    # the key/value loads of the next blocks are issued as asynchronous copies (a pipelined loop)
    assert one["loop_async_copies"] > 0 and four["loop_async_copies"] > 0
    # through the block table too, with as many stages of copies (the next page read a block ahead)
    assert paged["loop_async_copies"] == one["loop_async_copies"] and paged["shared_bytes"] == one["shared_bytes"]


def _run(script: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_reasoning_benchmark_smoke(tmp_path):
    """The reasoning workload on a tiny Qwen3 shape: the stop rule sized for the mean length, a
    varying reward, a step with its parts and length distribution, and the rollout-vs-trainer
    numerics of the engine and of HF generate (float32 on CPU: both tiny)."""
    out = tmp_path / "reasoning.json"
    _run("bench_reasoning.py", "--smoke", "--systems", "rlcore", "--workdir", str(tmp_path), "--out", str(out),
         cwd=tmp_path)
    payload = json.loads(out.read_text())
    workload = payload["workloads"]["tiny-qwen3"]
    assert workload["stop_count"] >= 1 and workload["stop_ids_head"][0] == 0
    row, = payload["results"]
    assert row["system"] == "rlcore" and row["rollout_backend"] == "RolloutEngine"
    assert row["step_s"] > 0 and row["parts"]["rollout"] > 0 and row["parts"]["update"] > 0
    lengths = row["lengths"]
    assert lengths["count"] == 16 and 1 <= lengths["mean"] <= 32 and lengths["max"] <= 32
    assert row["metrics"]["reward/std"] > 0  # the hashed reward varies, so advantages are not zero
    for name in ("rlcore_rollout", "hf_generate"):
        assert row["numerics"][name]["tokens"] > 0 and row["numerics"][name]["abs_diff_max"] < 1e-3


def test_reasoning_benchmark_with_fixed_lengths_decodes_the_same_lengths_in_two_settings(tmp_path):
    """--fixed-lengths: two runs of different settings decode the same response lengths, drawn up front,
    without the stop tokens that otherwise end them."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_reasoning

    def lengths(name: str, *extra: str) -> dict:
        out = tmp_path / f"{name}.json"
        _run("bench_reasoning.py", "--smoke", "--systems", "rlcore", "--numerics-prompts", "0", "--fixed-lengths",
             "--workdir", str(tmp_path / name), "--out", str(out), *extra, cwd=tmp_path)
        payload = json.loads(out.read_text())
        return payload["results"][0]["lengths"], payload["workloads"]["tiny-qwen3"]

    (first, workload), (second, _) = lengths("a"), lengths("b", "--rlcore-override", "actor.lr=1e-4")
    assert first == second
    cap = bench_reasoning.PRESETS["smoke"]["cap"]
    expected = bench_reasoning.geometric_lengths(first["count"], workload["stop_count"] / workload["vocab"], cap,
                                                 f"fixed-{bench_reasoning.PRESETS['smoke']['warmup'] + 1}")
    assert first["max"] == max(expected) and first["mean"] == pytest.approx(sum(expected) / len(expected))


def test_profiled_update_is_one_step_more_and_left_out_of_the_figures(tmp_path):
    """--profile-update: the update of one extra step runs under the profiler; its report (the window, the
    device's busy share, the idle stretches) is in the results, and the measured steps are those of a run
    without it."""
    def run(name: str, *extra: str) -> dict:
        out = tmp_path / f"{name}.json"
        _run("bench_reasoning.py", "--smoke", "--systems", "rlcore", "--numerics-prompts", "0", "--fixed-lengths",
             "--workdir", str(tmp_path / name), "--out", str(out), *extra, cwd=tmp_path)
        return json.loads(out.read_text())["results"][0]

    plain, profiled = run("plain"), run("profiled", "--profile-update")
    assert "update_idle" not in plain
    report = profiled["update_idle"]  # on CPU no device ran: nothing busy, no idle stretch between kernels
    assert report["window_s"] > 0 and report["busy_frac"] == 0 and report["count"] == 0
    assert len(profiled["step_times"]) == len(plain["step_times"])
    assert profiled["lengths"] == plain["lengths"] and profiled["samples_trained"] == plain["samples_trained"]


def test_fixed_lengths_keep_a_carried_samples_own_length(monkeypatch):
    """--fixed-lengths with partial rollouts: a sample the call leaves unfinished (here cut by
    ``stop_at_rows``) gets the rest of its drawn length at the next call, whose prompt holds its tokens."""
    from types import SimpleNamespace

    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.engine import RolloutEngine
    from rlcore.rollout.tiny import tiny_causal_lm

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_reasoning

    monkeypatch.setattr(RolloutEngine, "generate", RolloutEngine.generate)  # put back after the test
    model = tiny_causal_lm("qwen2")
    vocab, stop = int(model.config.vocab_size), 8
    trainer = SimpleNamespace(c=SimpleNamespace(policy=SimpleNamespace(config=model.config), eos_ids=[1]))
    bench_reasoning.fix_lengths(trainer, {"stop_ids": list(range(stop))})
    assert trainer.c.eos_ids == []
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=96, admit_fraction=0.0, eos_check_interval=1)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=0, stop_at_rows=1)
    drawn = bench_reasoning.geometric_lengths(len(prompts), stop / vocab, 40, "fixed-1")
    first = engine.generate(prompts, params)
    lengths = first.response_mask.sum(-1).tolist()
    (cut,) = first.cut.nonzero().flatten().tolist()  # the longest drawn one, cut when it alone was left
    assert cut == max(range(len(drawn)), key=drawn.__getitem__) and lengths[cut] < drawn[cut]
    assert [n for i, n in enumerate(lengths) if i != cut] == [d for i, d in enumerate(drawn) if i != cut]
    carried = prompts[cut] + first.response_ids[cut, :lengths[cut]].tolist()
    second = engine.generate([carried, [12, 13]], dataclasses.replace(params, stop_at_rows=0))
    assert int(second.response_mask[0].sum()) == drawn[cut] - lengths[cut]  # the rest of its own length
    assert int(second.response_mask[1].sum()) == bench_reasoning.geometric_lengths(1, stop / vocab, 40, "fixed-2")[0]


def test_layer_saved_bytes_probe_orders_the_three_forms(tmp_path):
    """The probe of a layer's kept activations: compiled layers keep less than eager ones, and less
    again when their backward recomputes the pointwise results."""
    out = tmp_path / "saved.json"
    _run("probes/layer_saved_bytes.py", "--tokens", "64", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    eager, compiled, recomputed = (rows[k]["bytes_per_token"] for k in (
        "eager", "compiled", "compiled+recompute_pointwise"))
    assert eager > compiled > recomputed > 0


def test_model_check_smoke(tmp_path):
    """The engine-vs-HF model check on a tiny Qwen3 shape (eager path, float32)."""
    out = tmp_path / "models.json"
    _run("check_models.py", "--shapes", "tiny-qwen3", "--dtype", "fp32", "--variants", "eager",
         "--prompts", "3", "--max-prompt", "24", "--new-tokens", "12", "--sampled-tokens", "16", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [r["shape"] for r in rows] == ["tiny-qwen3"]
    for row in rows:
        assert row["supported"] and row["greedy"]["rows_equal"] == 3 and row["greedy"]["untied_divergences"] == 0
        assert row["greedy"]["logprob_vs_trainer"]["abs_diff_max"] < 1e-3
        assert row["sampled"]["engine"]["abs_diff_max"] < 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("script", ["check_decode_attention.py", "bench_decode_parts.py", "probes/probe_attention.py",
                                    "probes/cudnn_masked_nan.py"])
def test_cuda_only_scripts_say_they_need_cuda(tmp_path, script):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script),
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "CUDA" in proc.stdout + proc.stderr


def test_reasoning_benchmark_stopped_by_sigterm_writes_what_it_did(tmp_path):
    """An outer ``timeout`` (SIGTERM to the driver) mid-run: the driver stops its worker, writes the
    results file with the run marked as stopped (its progress kept) and exits, starting nothing else."""
    import signal
    import time

    out = tmp_path / "reasoning.json"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "bench_reasoning.py"), "--smoke", "--systems",
                             "rlcore", "--workdir", str(tmp_path), "--out", str(out)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob("tiny-qwen3/progress-rlcore-*.json")):
        time.sleep(0.2)  # the rlcore worker has started
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)  # it exits soon after the signal (raises if not)
    row = json.loads(out.read_text())["results"][-1]
    assert row["system"] == "rlcore" and "stopped by SIGTERM" in (row.get("error") or row["numerics"]["error"])
    assert "progress" in row
