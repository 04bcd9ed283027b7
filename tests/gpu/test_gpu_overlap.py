"""On a CUDA machine: the overlapped update (``ppo.overlap_update``) beside the engine's CUDA-graph decode (graphs
captured while the worker thread launches its kernels) trains as the update after the rollout. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRPO = ("algorithm.adv_estimator=grpo", "ppo.ppo_epochs=1", "ppo.mini_batch_size=0", "ppo.kl_coeff=0",
        "ppo.micro_batch_size=6", "ppo.generation.max_new_tokens=48", "ppo.rollout_batch_size=16",
        "trainer.eval_samples=0", "trainer.max_steps=3", "trainer.device=cuda", "trainer.gpu_monitor=false",
        "trainer.progress=false", "trainer.export_final=false", "plugins=[]")


def _train(tmp_path, *overrides):
    from rlcore.testing import train_demo

    return train_demo(tmp_path, *GRPO, *overrides)


def test_the_overlapped_update_beside_cuda_graphs_trains_as_the_update_after_the_rollout(tmp_path):
    off, m_off, _ = _train(tmp_path / "off", "ppo.overlap_update=false")
    on, m_on, backends = _train(tmp_path / "on", "ppo.overlap_update=true")
    assert backends and getattr(backends[0], "use_cuda_graphs", False)  # recorded before the run closed them
    assert all(m["update/overlapped_frac"] > 0 and m["update/overlap_oom"] == 0 for m in m_on.values())
    for step in m_off:
        for key in ("loss/policy", "entropy/mean", "actor/grad_norm"):
            assert m_on[step][key] == pytest.approx(m_off[step][key], rel=2e-2, abs=1e-3), (step, key)
