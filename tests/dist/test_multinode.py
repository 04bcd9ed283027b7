"""Two nodes on one host: two ``torchrun`` launchers meet at a c10d rendezvous (``--nnodes=2``), each
with two gloo processes, train the demo; a run of another world size (2 processes) resumes from the
checkpoint the 4 processes wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]

COMMON = ["trainer.device=cpu", "trainer.progress=false", "trainer.eval_samples=8", "trainer.save_steps=2",
          "ppo.rollout_batch_size=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", RLCORE_DIST_TIMEOUT_S="120", TOKENIZERS_PARALLELISM="false")


def test_two_node_launch_then_resume_on_another_world_size(tmp_path):
    out = tmp_path / "run"
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               "--rdzv_id=rlcore-two-nodes", "-m", "rlcore", "train", *COMMON, "trainer.max_steps=2",
               f"trainer.output_dir={out}"]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    for p, log in zip(nodes, logs):
        assert p.returncode == 0, log[-5000:]
    assert (out / "checkpoints" / "step_00000002").is_dir()

    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "-m", "rlcore", "train", *COMMON, "trainer.max_steps=4", "trainer.resume=auto",
                              f"trainer.output_dir={out}"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                             timeout=600)
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text[-5000:]
    assert "world size changed since the checkpoint (4 -> 2 ranks)" in text, text[-5000:]
    assert (out / "checkpoints" / "step_00000004").is_dir()
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {2, 4} <= {s for s in steps if s is not None}, steps
