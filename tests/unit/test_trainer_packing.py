"""Packed forwards, token-budget micro-batches and per-micro-batch checkpointing change no number of the update."""

import copy

import pytest
import torch

from rlcore import rlmath
from rlcore.config.schema import PPOConfig
from rlcore.errors import ConfigError
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import packing, packing_check, recompute
from rlcore.trainer.experience import batched_logprobs, batched_values
from rlcore.trainer.models import ValueModel, response_logprobs, response_values
from rlcore.trainer.update import group_weights, ppo_update

from test_trainer_trim import ragged_experience


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_forward_equals_padded(impl):
    model = tiny_causal_lm("llama")
    model.config._attn_implementation = impl
    exp = ragged_experience(model, seed=3)
    mask = exp.response_mask.bool()
    padded, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len)
    packed, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len,
                                  response_mask=exp.response_mask, packed=True)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)
    assert packed[~mask].abs().max() == 0
    critic = ValueModel.from_causal_lm(model)
    v_pad = response_values(critic, exp.input_ids, exp.attention_mask, exp.response_len)
    v_pack = response_values(critic, exp.input_ids, exp.attention_mask, exp.response_len,
                             response_mask=exp.response_mask, packed=True)
    torch.testing.assert_close(v_pack[mask], v_pad[mask], rtol=1e-5, atol=1e-5)


def test_pack_layout():
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    resp = torch.tensor([[1, 1, 0], [1, 0, 0]])  # responses: [7, 8] and [12]
    rows = packing.pack(ids, mask, resp)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert rows.cu_seqlens.tolist() == [0, 4, 8] and rows.max_len == 4
    assert rows.index.tolist() == [1, 2, 6] and rows.labels.tolist() == [7, 8, 12]
    assert rows.unpack(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1, 2, 0], [3, 0, 0]]
    flash = torch.nn.Linear(1, 1)
    flash.config = type("C", (), {"_attn_implementation": "flash_attention_2"})()
    assert rows.forward_kwargs(flash)["cu_seq_lens_q"] is rows.cu_seqlens


def test_a_packed_row_is_filled_to_an_aligned_length_without_changing_the_real_tokens():
    """Compiled layers specialise on the row length's alignment: the row is filled up to a multiple of
    PACK_MULTIPLE by a sequence of its own, and the log-probs of the real tokens stay the same."""
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    resp = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rows = packing.pack(ids, mask, resp)
    assert rows.input_ids.shape[1] % packing.PACK_MULTIPLE == 0
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert rows.cu_seqlens.tolist() == [0, 4, 7, 8] and rows.index.tolist() == [1, 2]
    assert packing.pack(ids, mask, resp, multiple_of=1).input_ids.shape[1] == 7
    model = tiny_causal_lm("qwen2")
    ids = torch.randint(1, 60, (3, 13))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, 11:] = 0
    resp_mask = mask[:, 5:]
    lp_aligned, _ = response_logprobs(model, ids, mask, 8, response_mask=resp_mask, packed=True)
    rows = packing.pack(ids, mask, resp_mask, multiple_of=1)
    assert rows.input_ids.shape[1] % 8 != 0  # the check below compares a filled row with an unfilled one
    out = model(**rows.forward_kwargs(model), use_cache=False, logits_to_keep=rows.index)
    plain = rows.unpack(torch.log_softmax(out.logits[0].float(), -1).gather(-1, rows.labels[:, None].long())[:, 0])
    torch.testing.assert_close(lp_aligned, plain, rtol=1e-5, atol=1e-5)


def test_isolation_check_catches_a_model_that_mixes_packed_sequences(monkeypatch):
    """Without the packed-sequence mask (an attention that ignores restarting positions) the check says no."""
    import transformers.masking_utils as masking

    model = tiny_causal_lm("qwen2")
    assert packing_check.packing_isolates(model) == (True, "")
    assert packing_check.resolve_packing(True, [model, None]) is True
    assert packing_check.resolve_packing("auto", [model]) is False  # sdpa: a packed row is one dense masked attention
    monkeypatch.setattr(packing_check, "attention_implementation", lambda m: "flash_attention_2")
    assert packing_check.resolve_packing("auto", [model, None]) is True
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    ok, why = packing_check.packing_isolates(model)
    assert not ok and "sees the other sequence" in why
    assert packing_check.resolve_packing("auto", [model]) is False
    with pytest.raises(ConfigError, match="ppo.pack_sequences"):
        packing_check.resolve_packing(True, [model])
    assert packing_check.resolve_packing(False, [model]) is False


def test_token_groups(monkeypatch):
    prompt, response = [4, 4, 2, 2, 1], [6, 4, 4, 1, 1]  # totals 10, 8, 6, 3, 2
    assert packing.token_groups(prompt, response, 15, packed=True) == [[0], [1, 2], [3, 4]]
    # padded: rows x the longest sample (rows moved left), filled greedily...
    monkeypatch.setattr(packing, "LEAST_PADDING", False)
    assert packing.token_groups(prompt, response, 15, packed=False) == [[0], [1], [2, 3], [4]]
    # ...or cut where the padding saved pays for a micro-batch: as few micro-batches, 30 tokens, not 32
    monkeypatch.setattr(packing, "LEAST_PADDING", True)
    assert packing.token_groups(prompt, response, 15, packed=False) == [[0], [1], [2], [3, 4]]
    monkeypatch.setattr(packing, "MICRO_BATCH_COST_TOKENS", 0)  # free micro-batches: no padding at all
    assert packing.token_groups(prompt, response, 15, packed=False) == [[0], [1], [2], [3], [4]]
    assert packing.token_groups(prompt, response, 5, packed=True) == [[0], [1], [2], [3, 4]]  # longer: alone
    assert packing.split_to([[0, 1, 2, 3, 4]], 3, prompt, response, True) == [[0], [1], [2, 3, 4]]


@pytest.mark.parametrize("rows_left", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_least_padding_groups_beat_the_greedy_cut_within_the_budget(seed, rows_left, monkeypatch):
    from rlcore.trainer import aligned

    monkeypatch.setattr(aligned, "ENABLED", rows_left)  # the width: the longest sample, or prompt + response
    g = torch.Generator().manual_seed(seed)
    n = 40
    prompt = torch.randint(8, 200, (n,), generator=g).tolist()
    response = sorted(torch.randint(1, 900, (n,), generator=g).tolist(), reverse=seed % 2 == 0)
    budget = 2000

    def objective(groups):
        assert sorted(i for grp in groups for i in grp) == list(range(n))  # every sample once, in order
        assert all(grp == list(range(grp[0], grp[-1] + 1)) for grp in groups)
        costs = [packing.group_cost([prompt[i] for i in grp], [response[i] for i in grp], False) for grp in groups]
        assert all(c <= budget or len(grp) == 1 for c, grp in zip(costs, groups))
        return sum(costs) + packing.MICRO_BATCH_COST_TOKENS * len(groups)

    best = objective(packing.token_groups(prompt, response, budget, packed=False))
    monkeypatch.setattr(packing, "LEAST_PADDING", False)
    assert best <= objective(packing.token_groups(prompt, response, budget, packed=False))


def test_weights_count_tokens_and_sequences_with_tokens():
    resp = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]).float()
    groups = [torch.tensor([0]), torch.tensor([1, 2, 3])]
    assert group_weights(resp, groups, "token-mean") == pytest.approx([4 / 8, 4 / 8])
    # the empty row 2 is no sequence of the mean (rlmath.aggregate_loss skips it)
    assert group_weights(resp, groups, "seq-mean-token-mean") == pytest.approx([1 / 3, 2 / 3])


def _experience(model, critic, seed, packed):
    exp = ragged_experience(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    exp.scores = torch.randn(exp.size, generator=g)
    exp.rollout_logprobs = exp.old_logprobs - 0.05 * torch.rand(exp.old_logprobs.shape, generator=g)
    if critic is not None:
        exp.values = batched_values(critic, exp.input_ids, exp.attention_mask, exp.response_len, 8,
                                    exp.response_mask, packed=packed)
        rewards = rlmath.token_level_rewards(exp.scores, exp.response_mask)
        exp.advantages, exp.returns = rlmath.compute_gae(rewards, exp.values, exp.response_mask, 1.0, 0.95)
    else:
        adv = rlmath.grpo_advantages(exp.scores, 4)
        exp.advantages = rlmath.broadcast_sequence_advantages(adv, exp.response_mask)
    return exp


def _step(model, critic, exp, packed, recompute_policies=None, **ppo_kw):
    """One optimizer step (SGD, lr 1): metrics, gradients (= minus the weight change) and the new weights."""
    model, critic = copy.deepcopy(model), copy.deepcopy(critic)
    roles = {"actor": model} if critic is None else {"actor": model, "critic": critic}
    before = {r: [p.detach().clone() for p in m.parameters()] for r, m in roles.items()}
    opts = {r: torch.optim.SGD(m.parameters(), lr=1.0) for r, m in roles.items()}
    scheds = {r: torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for r, o in opts.items()}
    policies = recompute_policies(roles) if recompute_policies else None
    metrics = ppo_update(exp, actor=model, actor_opt=opts["actor"], actor_sched=scheds["actor"], actor_grad_clip=0.0,
                         critic=critic, critic_opt=opts.get("critic"), critic_sched=scheds.get("critic"),
                         ppo=PPOConfig(**ppo_kw), grad_accum=1, temperature=1.0, kl_loss_coef=0.0,
                         generator=torch.Generator().manual_seed(0), packed=packed, recompute=policies)
    grads = [b - p.detach() for r, m in roles.items() for p, b in zip(m.parameters(), before[r])]
    weights = [p.detach().clone() for m in roles.values() for p in m.parameters()]
    return metrics, grads, weights


def _close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_packed_update_equals_padded_update(estimator):
    model = tiny_causal_lm("qwen2")
    critic = ValueModel.from_causal_lm(tiny_causal_lm("qwen2", seed=1)) if estimator == "gae" else None
    exp = _experience(model, critic, seed=4, packed=False)
    kw = dict(micro_batch_size=3, rollout_is="token")
    pad_m, pad_g, pad_w = _step(model, critic, exp, packed=False, **kw)
    pack_m, pack_g, pack_w = _step(model, critic, exp, packed=True, **kw)
    assert max(float(g.abs().max()) for g in pad_g) > 1e-3
    _close(pack_g, pad_g)
    _close(pack_w, pad_w)
    for key in ("loss/policy", "actor/approx_kl", "rollout_is/weight_mean") + (("loss/value",) if critic else ()):
        assert pack_m[key] == pytest.approx(pad_m[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("loss_agg,packed", [("token-mean", False), ("token-mean", True),
                                             ("seq-mean-token-sum", True), ("seq-mean-token-mean", True)])
def test_token_budget_micro_batches_give_the_whole_batch_gradient(loss_agg, packed):
    """Micro-batches of different token counts (a budget) accumulate the gradient of one forward over all."""
    model = tiny_causal_lm("qwen2")
    critic = ValueModel.from_causal_lm(tiny_causal_lm("qwen2", seed=1))
    exp = _experience(model, critic, seed=5, packed=False)
    whole_m, whole, _ = _step(model, critic, exp, packed=False, micro_batch_size=8, loss_agg=loss_agg,
                              rollout_is="token")
    cut_m, cut, _ = _step(model, critic, exp, packed=packed, max_tokens_per_micro_batch=24, loss_agg=loss_agg,
                          rollout_is="token")
    assert cut_m["actor/micro_batches"] >= 3 and whole_m["actor/micro_batches"] == 1
    _close(cut, whole)
    # the step's metrics do not depend on the cut either (each micro-batch weighs its share)
    for key in ("loss/policy", "loss/value", "entropy/mean", "actor/approx_kl", "actor/clipfrac",
                "critic/clipfrac", "rollout_is/weight_mean"):
        assert cut_m[key] == pytest.approx(whole_m[key], rel=1e-4, abs=1e-6), key


def test_budgeted_no_grad_passes_equal_the_plain_ones():
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=6)
    m = exp.response_mask.bool()
    plain = batched_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, 1.0, 8)
    for packed in (False, True):
        cut = batched_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, 1.0, 8,
                               exp.response_mask, max_tokens=20, packed=packed)
        torch.testing.assert_close(cut[m], plain[m], rtol=1e-5, atol=1e-5)


def test_auto_checkpointing_recomputes_only_what_does_not_fit(monkeypatch):
    model = tiny_causal_lm("qwen2")
    from rlcore.distributed.fsdp import enable_gradient_checkpointing

    enable_gradient_checkpointing(model)
    policy = recompute.Recompute(model, "auto", model.config, torch.device("cpu"))
    per_token = recompute.activation_bytes_per_token(model.config, torch.float32)
    # 2 layers x (6*64 + 2*32 + 4*128) floats + one row of 128 logits
    assert per_token == 2 * (6 * 64 + 2 * 32 + 4 * 128) * 4 + 128 * 4
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # the first backward's, kept out
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 100 * per_token + grads / recompute.FREE_SHARE)
    seen = []
    layer = recompute.switchable_layers(model)[0]
    for tokens in (50, 200):
        with policy.for_tokens(tokens):
            seen.append(layer.gradient_checkpointing)
    assert seen == [False, True] and not layer.gradient_checkpointing
    assert policy.take_metrics() == {"actor/recompute_frac": 0.5, "actor/activation_mb_per_token": per_token / 1e6}
    # the update with checkpointing on for every long micro-batch has the same gradient
    exp = _experience(model, None, seed=7, packed=False)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 0)
    _, plain, _ = _step(model, None, exp, packed=True, micro_batch_size=4)

    def policies(roles):
        return {"actor": recompute.Recompute(roles["actor"], "auto", model.config, torch.device("cpu"))}

    metrics, checkpointed, _ = _step(model, None, exp, packed=True, recompute_policies=policies, micro_batch_size=4)
    _close(checkpointed, plain)
