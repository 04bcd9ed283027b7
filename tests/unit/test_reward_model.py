"""The Hugging Face reward-model backend: last-token scores, re-tokenization, dtypes, start-up errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from rlcore.config.schema import RewardConfig, RewardFunctionConfig, RewardModelConfig
from rlcore.distributed.placement import ColocatedPlacement
from rlcore.errors import RewardError
from rlcore.protocols import DistInfo, PlacementRequest, RewardInput
from rlcore.rewards.backend import build_reward_backend
from rlcore.rewards.reward_model import ResidentScorer, RewardModel, check_reward_model_dir
from rlcore.rewards.rules import BUILTIN_REWARDS
from rlcore.rewards.tiny import build_tiny_reward_model

# Marks the assistant turn with the letter "k" (a word of the tiny vocabulary).
TEMPLATE = "{% for m in messages %}{% if m['role'] == 'assistant' %}k {% endif %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"))


@pytest.fixture(scope="module")
def tok(rm_dir):
    return AutoTokenizer.from_pretrained(rm_dir)


def make_batch(tok, prompts, responses, **extras):
    ids = lambda t: tok.convert_tokens_to_ids(t.split())  # noqa: E731 - the demo tokenizer is word level
    return RewardInput(prompts=list(prompts), responses=list(responses), prompt_ids=[ids(p) for p in prompts],
                       response_ids=[ids(r) for r in responses], extras={k: list(v) for k, v in extras.items()})


PROMPTS = ["a b c", "d e", "f g h i j k", "l"]
RESPONSES = ["a", "b c d e", "e", "f g"]


def load(path, tok, **cfg):
    return RewardModel.load(RewardModelConfig(enable=True, path=path, **{"dtype": "fp32", **cfg}), tok)


def test_scores_equal_the_models_own_forward_at_any_micro_batch(rm_dir, tok):
    batch = make_batch(tok, PROMPTS, RESPONSES)
    rm = load(rm_dir, tok, micro_batch_size=1)
    assert not rm.retokenize  # same tokenizer: the policy's ids are used as they are
    ref = torch.tensor([rm.module(input_ids=torch.tensor([p + r])).logits.item()
                        for p, r in zip(batch.prompt_ids, batch.response_ids)])
    for mb in (1, 3, 16):
        rm.micro_batch_size = mb
        got = ResidentScorer(rm, torch.device("cpu"))(batch).scores
        torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-5)
    assert ref.std() > 0.1  # the scores differ between samples


def test_score_is_read_at_the_last_token(rm_dir, tok):
    rm = load(rm_dir, tok)
    base = rm.forward([[5, 6, 7, 8]], torch.device("cpu"))
    assert rm.forward([[5, 6, 7, 9]], torch.device("cpu")) != base  # the last token matters
    # padding a shorter neighbour in the same micro-batch changes nothing
    both = rm.forward([[5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11]], torch.device("cpu"))
    torch.testing.assert_close(both[0], base[0], rtol=1e-5, atol=1e-5)


def test_bf16_scores_are_close_to_fp32(rm_dir, tok):
    batch = make_batch(tok, PROMPTS, RESPONSES)
    fp32 = torch.tensor(ResidentScorer(load(rm_dir, tok), torch.device("cpu"))(batch).scores)
    bf16 = torch.tensor(ResidentScorer(load(rm_dir, tok, dtype="bf16"), torch.device("cpu"))(batch).scores)
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.1)


def test_long_inputs_keep_their_last_tokens(rm_dir, tok):
    rm = load(rm_dir, tok, max_length=3)
    seqs, truncated = rm.encode(make_batch(tok, ["a b c", "a"], ["d e", "b"]))
    assert truncated == 1 and seqs[0] == tok.convert_tokens_to_ids(["c", "d", "e"])
    res = ResidentScorer(rm, torch.device("cpu"))(make_batch(tok, ["a b c"], ["d e"]))
    assert res.metrics["reward/rm_truncated"] == 1.0


def test_retokenizes_through_its_own_chat_template(tmp_path, tok):
    path = build_tiny_reward_model(str(tmp_path / "chat_rm"), chat_template=TEMPLATE)
    rm = load(path, tok)
    assert rm.retokenize  # the policy tokenizer has no chat template: inputs are rendered again
    rm_tok = rm.tokenizer
    batch = make_batch(tok, ["a b", "c"], ["d", "e f"],
                       messages=[None, [{"role": "system", "content": "g"}, {"role": "user", "content": "c"}]])
    seqs, _ = rm.encode(batch)
    assert rm_tok.convert_ids_to_tokens(seqs[0]) == ["a", "b", "k", "d"]  # prompt as the user turn
    assert rm_tok.convert_ids_to_tokens(seqs[1]) == ["g", "c", "k", "e", "f"]  # the chat column's messages
    scores = ResidentScorer(rm, torch.device("cpu"))(batch).scores
    assert scores[0] == pytest.approx(rm.forward([seqs[0]], torch.device("cpu")).item(), abs=1e-5)


@pytest.mark.parametrize("case, match", [
    ("unset", "reward_model.path is not set"),
    ("missing", "does not exist"),
    ("empty", "no config.json"),
    ("causal", "is not a sequence-classification model .*ForCausalLM"),
    ("two_labels", "num_labels=2"),
])
def test_unusable_reward_models_fail_at_start_up(tmp_path, rm_dir, tiny_model_dir, case, match):
    path = {"unset": None, "missing": str(tmp_path / "nope"), "empty": str(tmp_path), "causal": tiny_model_dir,
            "two_labels": str(tmp_path / "two")}[case]
    if case == "two_labels":
        os.makedirs(path)
        with open(os.path.join(rm_dir, "config.json")) as f:
            config = json.load(f)
        config["id2label"] = {"0": "a", "1": "b"}
        config["label2id"] = {"a": 0, "b": 1}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    with pytest.raises(RewardError, match=match):
        check_reward_model_dir(path)
    placement = ColocatedPlacement(PlacementRequest(reward="cpu"), DistInfo())
    with pytest.raises(RewardError, match=match):  # the backend fails when it is built, not at the first step
        build_reward_backend(RewardModelConfig(enable=True, path=path), RewardFunctionConfig(), RewardConfig(),
                             placement, None, dict(BUILTIN_REWARDS))


def test_bad_dtype(rm_dir, tok):
    with pytest.raises(RewardError, match="reward_model.dtype 'fp8'"):
        load(rm_dir, tok, dtype="fp8")


def test_reward_model_and_function_are_summed(rm_dir, tok):
    placement = ColocatedPlacement(PlacementRequest(reward="cpu"), DistInfo())
    cfg = RewardModelConfig(enable=True, path=rm_dir, dtype="fp32")
    batch = make_batch(tok, PROMPTS, RESPONSES, ground_truth=["a", "x", "e", "x"])
    rm_only = build_reward_backend(cfg, RewardFunctionConfig(), RewardConfig(), placement, tok, dict(BUILTIN_REWARDS))
    combo = build_reward_backend(cfg, RewardFunctionConfig(), RewardConfig(weights={"exact_match": 2.0, "rm": 0.5}),
                                 placement, tok, dict(BUILTIN_REWARDS))
    rm_scores = rm_only.score(batch).scores
    out = combo.score(batch)
    torch.testing.assert_close(out.scores, 0.5 * rm_scores + 2.0 * torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert out.metrics["reward/rm"] == pytest.approx(float(rm_scores.mean()), abs=1e-5)
    assert out.metrics["reward/exact_match"] == 0.5


def test_a_reward_model_directory_with_the_word_tokenizer_loads_it_as_saved(tmp_path):
    """The reward model's tokenizer loads as the policy's does: a directory that declares the generic
    fast class keeps its word tokenizer (spaces kept), so both sides count as one tokenizer."""
    from rlcore.demo import build_model_dir
    from rlcore.rewards.reward_model import _load_tokenizer, same_tokenizer
    from rlcore.trainer.models import load_tokenizer

    path = build_model_dir(str(tmp_path / "rm"))
    rm_tok, policy_tok = _load_tokenizer(path), load_tokenizer(path)
    assert rm_tok.decode(rm_tok("c k a f")["input_ids"], skip_special_tokens=True) == "c k a f"
    assert same_tokenizer(policy_tok, rm_tok)
