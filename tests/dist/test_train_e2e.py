"""The whole trainer in two processes: ``torchrun -m rlcore train`` and ``rlcore train trainer.nproc_per_node=2``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]

COMMON = ["trainer.max_steps=2", "trainer.device=cpu", "trainer.progress=false", "trainer.eval_samples=8"]


def run(cmd: list[str], cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCORE_DIST_TIMEOUT_S="120", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_trained(proc: subprocess.CompletedProcess, out_dir) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (out_dir / "checkpoints" / "step_00000002").is_dir(), os.listdir(out_dir)
    assert (out_dir / "final" / "config.json").is_file()


def test_torchrun_two_processes(tmp_path):
    out = tmp_path / "run"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "rlcore", "train", *COMMON, f"trainer.output_dir={out}"], tmp_path)
    assert_trained(proc, out)


def test_nproc_per_node_starts_the_elastic_launcher_with_remesh(tmp_path):
    out = tmp_path / "run"
    proc = run([sys.executable, "-m", "rlcore", "train", *COMMON, f"trainer.output_dir={out}",
                "trainer.nproc_per_node=2", "plugins=[remesh]", "actor.remeshing.enabled=true",
                "actor.remeshing.training_shard_size=2", "actor.remeshing.generation_shard_size=2"], tmp_path)
    assert_trained(proc, out)
    assert "starting 2 worker processes" in proc.stderr + proc.stdout


def test_streaming_with_an_uneven_held_out_set_and_a_global_log_level(tmp_path):
    """Streaming shards the held-out rows too (17 and 16 here): both ranks still make the same
    generation calls, and the summary shows the mean over every rank's prompts, as the log does.
    ``--log-level`` before the command reaches the workers of rlcore's launcher."""
    import json

    from rlcore.data.synthetic import write_parquet_shards

    train = write_parquet_shards(str(tmp_path / "train"), [64])
    val = write_parquet_shards(str(tmp_path / "val"), [33], seed=1)
    out = tmp_path / "run"
    proc = run([sys.executable, "-m", "rlcore", "--log-level", "WARNING", "train", *COMMON, f"trainer.output_dir={out}",
                "trainer.nproc_per_node=2", "--plugins", "streaming,sparse-logging", f"data.train_files=[{train[0]}]",
                f"data.val_files=[{val[0]}]", "trainer.eval_samples=64", "ppo.generation.batch_size=8",
                "ppo.rollout_batch_size=4"], tmp_path)
    assert_trained(proc, out)
    text = proc.stdout + proc.stderr
    assert " INFO " not in text  # the workers log at the level given to the launcher
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_means = [r["reward_mean"] for r in records if r.get("split") == "val"]
    assert len(val_means) == 2, records  # before and after training
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("held-out mean reward:"))
    assert summary.startswith(f"held-out mean reward: {val_means[0]:.3f} -> {val_means[1]:.3f}"), (summary, val_means)


def test_bad_setting_fails_the_launch_before_any_worker_starts(tmp_path):
    proc = run([sys.executable, "-m", "rlcore", "train", *COMMON, f"trainer.output_dir={tmp_path / 'run'}",
                "trainer.nproc_per_node=2", "plugins=[remesh]", "actor.remeshing.enabled=true",
                "actor.remeshing.training_shard_size=3"], tmp_path, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    assert "'actor.remeshing.training_shard_size' = 3 does not divide the world size 2" in text
    assert "distributed training failed" not in text  # caught by the launcher's checks, no worker started


def test_worker_failure_fails_the_launch_with_a_clear_error(tmp_path):
    # a reward module that imports in the launcher's checks but fails in the worker of rank 1
    reward = tmp_path / "failing_reward.py"
    reward.write_text("import os\n"
                      "if os.environ.get('RANK') == '1':\n"
                      "    raise RuntimeError('injected failure on rank 1')\n"
                      "def compute_score(prompts, responses, **kw):\n"
                      "    return [0.0 for _ in responses]\n")
    proc = run([sys.executable, "-m", "rlcore", "train", *COMMON, f"trainer.output_dir={tmp_path / 'run'}",
                "trainer.nproc_per_node=2", f"custom_reward_function.path={reward}"], tmp_path, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    assert "distributed training failed: rank 1" in text and "the other ranks were stopped" in text, text[-4000:]
    assert "injected failure on rank 1" in text
    assert "distributed training failed: rank" in text and "the other ranks were stopped" in text


def test_lora_actor_with_fsdp2_in_two_processes_checkpoints_resumes_and_exports(tmp_path):
    """A LoRA actor (peft) sharded with FSDP2 over two gloo processes: the reference is the actor with its
    adapters off, the adapters and their optimizer state are checkpointed (DCP) and a resumed run continues;
    the export writes the merged model and the adapter."""
    pytest.importorskip("peft")
    out = tmp_path / "run"
    lora = ["algorithm.adv_estimator=grpo", "ppo.generation.n=2", "ppo.kl_coeff=0.01", "actor.lora.rank=4",
            "actor.lora.alpha=8", "trainer.save_steps=1", f"trainer.output_dir={out}"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rlcore",
              "train", *COMMON]
    assert_trained(run(launch + lora, tmp_path), out)
    assert (out / "final-adapter" / "adapter_config.json").is_file()
    resumed = run(launch + lora + ["trainer.max_steps=3", "trainer.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert (out / "checkpoints" / "step_00000003").is_dir()
