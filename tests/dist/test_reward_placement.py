"""``placement.rank_groups.reward=[0]`` over two CPU processes (gloo, torchrun): the reward model
loads on rank 0 only, rank 1's samples are scored there with the scores colocated scoring gives,
and a reward that raises on rank 0 fails both ranks with its message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlcore.rewards.tiny import build_tiny_reward_model

pytestmark = [pytest.mark.slow, pytest.mark.dist]

WORKER = os.path.join(os.path.dirname(__file__), "reward_worker.py")


def launch(tmp_path, rm_dir: str, case: str) -> subprocess.CompletedProcess:
    """Two gloo processes of the worker; the subprocess timeout only guards against a hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCORE_DIST_TIMEOUT_S="60", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor_interval=0.5", WORKER, "--out", str(tmp_path), "--rm", rm_dir, "--case", case]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"))


def test_reward_ranks_score_for_the_others(tmp_path, rm_dir):
    proc = launch(tmp_path, rm_dir, "scores")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["loads"] == [1, 0], "the reward model must load on rank 0 only"
    assert rec["backend_on"] == [True, False]
    assert rec["routed"] == rec["colocated"]  # float32 scores, bit for bit
    assert rec["routed"][0] != rec["routed"][1]  # each rank got its own samples' scores back


def test_a_raising_reward_fails_both_ranks(tmp_path, rm_dir):
    proc = launch(tmp_path, rm_dir, "raise")
    assert proc.returncode != 0
    for rank in (0, 1):
        path = tmp_path / f"error{rank}.txt"
        assert path.exists(), f"rank {rank} did not see the reward error\n{proc.stderr[-4000:]}"
        text = path.read_text()
        assert "reward blew up on purpose" in text and "scored on reward rank 0 for the samples of rank 1" in text
    assert "reward blew up on purpose" in proc.stdout + proc.stderr
