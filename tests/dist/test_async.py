"""The ``async`` plugin end to end: ``torchrun --nproc_per_node=3`` on CPU (gloo), two training ranks
and one rollout rank, on the demo task.

Each run goes through a small wrapper of ``rlcore train`` that records, per training rank and step,
the prompt tokens the step trained on (``prompts.<rank>.jsonl``), and can SIGKILL training rank 0
at the start of a chosen step.

* synchronous (``max_staleness=0``, the same ranks): the rollout's log-probs match the trainer's at
  every step, though the policy moves by more than that each step (the one-step-stale run shows the
  gap): the rollout rank generates with the weights of every update. Its learning is the reference
  the asynchronous run's is compared with, and its prompts the reference order of the data;
* one-step off-policy (``max_staleness=1``), SIGKILLed at the start of step 5 (checkpoint of step 4,
  the samples of step 5 already queued) and resumed: samples flow, every step's staleness is
  ``min(1, step - 1)`` (0 again for the first step after the resume: the queued prompts are drawn
  again and generated with the checkpoint's weights) and its policy version
  ``step - 1 - staleness``; the held-out reward rises; and the run trained on exactly the prompts of
  the synchronous run, step by step: none lost, none repeated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 8
ARGS = ["--plugins", "async,sparse-logging", "trainer.device=cpu", f"trainer.max_steps={STEPS}",
        "trainer.progress=false", "trainer.log_steps=1", "trainer.save_steps=2", "trainer.eval_samples=32",
        "trainer.gpu_monitor=false", "trainer.export_final=false", "trainer.resume=auto", "ppo.rollout_is=token",
        "actor.lr=3e-3", "actor.warmup_steps=1", "plugin_config.async.rollout_ranks=1"]

#: ``rlcore train`` that records each trained step's prompts and, on training rank 0 at the start of
#: step $KILL_AT (or on the rollout rank in its generation call number $KILL_ROLLOUT_AT), kills itself
#: with SIGKILL.
WRAPPER = r"""
import json, os, signal, sys
from rlcore.plugins import async_rl
from rlcore.trainer.scoring import rows

original = async_rl.AsyncSource.next
def next(self, step):
    rank = self.trainer.dist.rank
    if rank == 0 and os.environ.get("KILL_AT") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    batch = original(self, step)
    with open(os.path.join(self.trainer.tcfg.output_dir, f"prompts.{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "prompts": rows(batch.rollout.prompt_ids, batch.rollout.prompt_mask)}) + "\n")
    return batch
async_rl.AsyncSource.next = next

original_generate = async_rl.RolloutWorker._generate
def _generate(self, prompts, params):
    self.calls = getattr(self, "calls", 0) + 1
    if os.environ.get("KILL_ROLLOUT_AT") == str(self.calls):
        os.kill(os.getpid(), signal.SIGKILL)
    return original_generate(self, prompts, params)
async_rl.RolloutWorker._generate = _generate

original_run = async_rl.RolloutWorker.run
def run(self):
    if os.environ.get("KILL_ROLLOUT_ON_STOP"):  # dies once the trainers have saved their last checkpoint
        get = self.inbox.get
        def get_or_die(*a, **kw):
            msg = get(*a, **kw)
            if msg[0] == "stop":
                os.kill(os.getpid(), signal.SIGKILL)
            return msg
        self.inbox.get = get_or_die
    return original_run(self)
async_rl.RolloutWorker.run = run
from rlcore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _launch(tmp: Path, out: Path, *extra: str, kill_at: int = 0, kill_rollout_at: int = 0,
            kill_rollout_on_stop: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    script = tmp / "train_wrapper.py"
    script.write_text(WRAPPER)
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCORE_DIST_TIMEOUT_S="120", TOKENIZERS_PARALLELISM="false",
               KILL_AT=str(kill_at), KILL_ROLLOUT_AT=str(kill_rollout_at),
               KILL_ROLLOUT_ON_STOP="1" if kill_rollout_on_stop else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script),
           "train", *ARGS, f"trainer.output_dir={out}", *extra]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    return text


def _train_records(out: Path) -> dict[int, dict]:
    """The last train record of every step (a resumed run writes the steps after its checkpoint again)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["split"] == "train"}


def _held_out(out: Path) -> tuple[float, float]:
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["reward_mean"] for r in val if r["split"] == "val"]
    return val[0], val[-1]


def _prompts(out: Path) -> dict[tuple[int, int], list]:
    """(training rank, step) -> the prompts trained on; a step written twice (before a crash and after
    the resume) keeps its last record."""
    got = {}
    for rank in (0, 1):
        for line in (out / f"prompts.{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            got[rank, rec["step"]] = rec["prompts"]
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """The synchronous split run, and a one-step off-policy run of the same task, seed and ranks that
    is SIGKILLed at the start of step 5 (checkpoint of step 4, the samples of step 5 queued) and
    resumed."""
    tmp = tmp_path_factory.mktemp("async")
    out: dict[str, Any] = {"sync": tmp / "sync", "async": tmp / "async"}
    _ok(_launch(tmp, out["sync"], "plugin_config.async.max_staleness=0"))
    killed = _launch(tmp, out["async"], "plugin_config.async.max_staleness=1", kill_at=5)
    out["killed_rc"] = killed.returncode
    out["latest_after_kill"] = (out["async"] / "checkpoints" / "latest").read_text().strip()
    out["resumed_log"] = _ok(_launch(tmp, out["async"], "plugin_config.async.max_staleness=1"))
    return out


def test_samples_flow_with_bounded_staleness_and_the_task_learns(runs):
    records = _train_records(runs["async"])
    assert sorted(records) == list(range(1, STEPS + 1))
    # staleness min(1, step - 1); the first step after the resume (5) generates with the checkpoint's weights
    assert [records[s]["async/staleness"] for s in records] == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    for step, r in records.items():
        assert r["async/policy_version"] == step - 1 - r["async/staleness"], (step, r)
        assert r["async/queued_steps"] == (1 if step < STEPS else 0), (step, r)
        assert r["response/length_mean"] > 0
    # the stale samples' log-probs differ from the trainer's (one update apart), and rollout_is saw them
    assert min(records[s]["rollout/logprob_abs_diff_mean"] for s in (2, 3, 4, 6, 7, 8)) > 0.02
    assert all("rollout_is/weight_mean" in records[s] for s in records)
    before, after = _held_out(runs["async"])
    assert after > before + 0.2, (before, after)


def test_synchronous_split_generates_with_every_update_and_async_learns_as_well(runs):
    records = _train_records(runs["sync"])
    assert sorted(records) == list(range(1, STEPS + 1))
    for step, r in records.items():
        assert r["async/staleness"] == 0 and r["async/policy_version"] == step - 1, (step, r)
        # engine (bf16 on CPU) against the trainer: rounding only, at every step after every update
        assert r["rollout/logprob_abs_diff_mean"] < 0.01, (step, r)
    sync_before, sync_after = _held_out(runs["sync"])
    async_before, async_after = _held_out(runs["async"])
    assert sync_before == async_before
    assert async_after - async_before >= 0.6 * (sync_after - sync_before), (sync_after, async_after)


def test_resume_after_sigkill_trains_on_every_prompt_once(runs):
    assert runs["killed_rc"] != 0
    assert runs["latest_after_kill"] == "step_00000004"
    assert "step_00000004 (step 4)" in runs["resumed_log"]
    # the data order does not depend on the staleness: the synchronous run's prompts are the reference
    reference, got = _prompts(runs["sync"]), _prompts(runs["async"])
    assert sorted(got) == sorted(reference) == [(rank, step) for rank in (0, 1) for step in range(1, STEPS + 1)]
    for key in sorted(reference):
        assert got[key] == reference[key], f"training rank {key[0]}, step {key[1]}: other prompts after the resume"


def test_a_rollout_rank_that_dies_stops_the_run_with_an_error_naming_it(tmp_path):
    proc = _launch(tmp_path, tmp_path / "run", kill_rollout_at=3, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # training rank 0 notices while waiting for samples, or (when the launcher's SIGTERM came first and
    # the trainers finished their step) while stopping the rollout ranks
    assert re.search(r"BridgeError: (waiting for|sending to) rollout rank 0 \(job rank 2\) failed", text), text[-4000:]


def test_a_completed_run_resumed_has_nothing_to_do_and_exits_0(tmp_path):
    """The rollout rank dies once the last checkpoint is written; the same command with
    trainer.resume=auto then trains no step: the trainers still stop the (new) rollout rank, and the
    job exits 0 at once instead of failing in the rollout rank's wait for a request."""
    lean = ["trainer.max_steps=1", "trainer.save_steps=1", "trainer.eval_samples=4", "ppo.rollout_batch_size=2",
            "ppo.generation.n=2", "ppo.mini_batch_size=2", "ppo.generation.max_new_tokens=4",
            "plugin_config.async.max_staleness=0"]
    out = tmp_path / "run"
    died = _launch(tmp_path, out, *lean, kill_rollout_on_stop=True, timeout=120)
    assert died.returncode != 0
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    again = _launch(tmp_path, out, *lean, timeout=90)
    text = _ok(again)
    assert "nothing to train" in text
    assert "BridgeError" not in text
