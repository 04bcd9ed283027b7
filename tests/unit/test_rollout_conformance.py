"""Both built-in rollout backends, built through rlcore_rollout_backend, pass rlcore.testing's conformance suite."""

from __future__ import annotations

import pytest
import torch

from rlcore.rollout import make_backend
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.testing import RolloutConformanceError, check_rollout_backend

CHECKS = ["protocol", "shapes", "masks", "eos", "seeds", "logprobs", "sync_weights"]


@pytest.mark.parametrize("kind", ["hf", "engine"])
def test_builtin_backends_pass_the_conformance_suite(kind):
    def build(model):
        return make_backend(model, kind, max_batch_size=8, max_seq_len=32)

    assert check_rollout_backend(build, tiny_causal_lm("qwen2")) == CHECKS


def test_the_suite_catches_a_backend_that_ignores_sync_weights():
    from rlcore.rollout.engine import RolloutEngine

    class Stale(RolloutEngine):
        def sync_weights(self):
            pass  # keeps the weights it copied

    with pytest.raises(RolloutConformanceError, match="check 'sync_weights' failed"):
        check_rollout_backend(lambda m: Stale(m, max_batch_size=8, max_seq_len=32, share_weights=False),
                              tiny_causal_lm("qwen2"))


def test_the_suite_catches_wrong_logprobs():
    from rlcore.rollout.hf import HFGenerateBackend

    class Tempered(HFGenerateBackend):
        def generate(self, prompts, params):
            batch = super().generate(prompts, params)
            batch.logprobs = batch.logprobs * 0.5  # not the sampled tokens' log-probs
            return batch

    with pytest.raises(RolloutConformanceError, match="check 'logprobs' failed"):
        check_rollout_backend(lambda m: Tempered(m), tiny_causal_lm("qwen2"))
    assert torch.is_grad_enabled()
