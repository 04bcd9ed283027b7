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

    # both play episodes: HF generate turn by turn, the engine in its paged KV cache
    assert check_rollout_backend(build, tiny_causal_lm("qwen2")) == CHECKS + ["episodes"]


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


# ---------------------------------------------------------------------------------------------
# Every rule of the plugin boundary's contract is a RolloutConformanceError, never an AttributeError
# ---------------------------------------------------------------------------------------------


def _broken(change):
    from rlcore.rollout.hf import HFGenerateBackend

    class Broken(HFGenerateBackend):
        supports_episodes = False

        def generate(self, prompts, params):
            return change(super().generate(prompts, params))

    return lambda model: Broken(model)


def _set(**values):
    def change(batch):
        for name, value in values.items():
            setattr(batch, name, value(batch) if callable(value) else value)
        return batch
    return change


@pytest.mark.parametrize("change, expected", [
    (_set(logprobs=None), "logprobs is missing"),
    (_set(prompt_ids=lambda b: b.prompt_ids[:-1], prompt_mask=lambda b: b.prompt_mask[:-1]), "rows for 4 prompts"),
    (_set(logprobs=lambda b: b.logprobs[:, :-1]), "differs from response_ids"),
    (_set(logprobs=lambda b: b.logprobs + float("nan")), "not finite"),
    (_set(response_ids=lambda b: b.response_ids + 10_000), "outside the vocabulary"),
    (_set(response_mask=lambda b: b.response_mask * 3), "values other than 0 and 1"),
    (_set(prompt_ids=lambda b: b.prompt_ids.flip(0), prompt_mask=lambda b: b.prompt_mask.flip(0)), "not prompt 0"),
    (_set(cut=lambda b: torch.zeros(b.batch_size + 1, dtype=torch.bool)), "cut is torch.bool of shape"),
    (_set(cut=lambda b: torch.zeros(b.batch_size)), "cut is torch.float32"),
])
def test_the_suite_names_every_rule_of_the_contract(change, expected):
    with pytest.raises(RolloutConformanceError, match=f"check 'shapes' failed: the batch breaks the contract: .*{expected}"):
        check_rollout_backend(_broken(change), tiny_causal_lm("qwen2"))


def test_hf_and_a_static_engine_play_episodes_in_the_suite():
    def engine(model):
        return make_backend(model, "engine", max_batch_size=8, max_seq_len=48, kv_cache="static")

    assert check_rollout_backend(engine, tiny_causal_lm("qwen2"))[-1] == "episodes"


def test_the_suite_catches_a_backend_that_claims_episodes_but_plays_plain_prompts():
    from rlcore.rollout.hf import HFGenerateBackend

    class Claims(HFGenerateBackend):
        def generate(self, prompts, params):
            return self._generate([list(p) for p in prompts], params)  # one turn, never reaching the episode

    with pytest.raises(RolloutConformanceError, match="check 'episodes' failed: prompt 0 carried an episode"):
        check_rollout_backend(lambda m: Claims(m), tiny_causal_lm("qwen2"))
