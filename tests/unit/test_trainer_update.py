"""The actor update's shortcuts change nothing: on-policy old log-probs, entropy kept out of autograd."""

import math
from collections import defaultdict

import pytest
import torch

from rlcore.config.schema import PPOConfig
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer.experience import Experience
from rlcore.trainer.models import response_logprobs
from rlcore.trainer.update import actor_micro_loss, on_policy


def _experience(model, batch=4, prompt=5, response=6, seed=0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # one left-padded prompt
    resp_mask = torch.ones(batch, response)
    resp_mask[1, -2:] = 0  # one early-stopped response
    with torch.no_grad():
        old, _ = response_logprobs(model, ids, mask, response)
    return Experience(input_ids=ids, attention_mask=mask, response_mask=resp_mask, old_logprobs=old,
                      scores=torch.zeros(batch), advantages=torch.randn(batch, response, generator=g))


def _grads(model, exp: Experience, ppo: PPOConfig) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    actor_micro_loss(model, exp, ppo, temperature=1.0, kl_loss_coef=0.0, weight=1.0, stats=defaultdict(list))
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_on_policy_old_logprobs_give_the_same_gradient():
    model = tiny_causal_lm("qwen2")
    exp = _experience(model)
    ppo = PPOConfig()
    recomputed = _grads(model, exp, ppo)
    exp.old_logprobs = None
    own = _grads(model, exp, ppo)
    assert len(own) == len(recomputed) > 0
    for a, b in zip(own, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("coeff", [0.0, 0.05])
def test_entropy_term_gradient(coeff):
    """Entropy out of autograd when its weight is 0; a nonzero weight still moves the gradient."""
    model = tiny_causal_lm("qwen2")
    exp = _experience(model, seed=1)
    base = _grads(model, exp, PPOConfig(entropy_coeff=0.0))
    got = _grads(model, exp, PPOConfig(entropy_coeff=coeff))
    diff = max(float((a - b).abs().max()) for a, b in zip(got, base))
    assert (diff == 0.0) == (coeff == 0.0)


def test_entropy_without_grad_matches():
    model = tiny_causal_lm("qwen2")
    exp = _experience(model, seed=2)
    _, with_grad = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, with_entropy=True)
    _, no_grad = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, with_entropy=True,
                                   entropy_grad=False)
    assert with_grad.requires_grad and not no_grad.requires_grad
    torch.testing.assert_close(no_grad, with_grad.detach())


@pytest.mark.parametrize("epochs,mini,accum,expected", [
    (1, 0, 1, True), (1, 0, 4, True), (1, 64, 2, True), (1, 32, 1, False), (2, 0, 1, False)])
def test_on_policy_rule(epochs, mini, accum, expected):
    ppo = PPOConfig(ppo_epochs=epochs, mini_batch_size=mini, micro_batch_size=8)
    assert on_policy(64, ppo, accum) is expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_log_softmax(monkeypatch, temperature):
    """Values, entropy and gradient of the reference path equal plain log_softmax, with chunks splitting rows."""
    from rlcore import rlmath
    from rlcore.trainer import models

    monkeypatch.setattr(models, "LOGPROB_KERNELS", False)
    monkeypatch.setattr(rlmath, "_LOGIT_CHUNK_ELEMENTS", 3 * 50)  # 3 positions per chunk, 9 chunks
    g = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(3, 9, 50, generator=g, dtype=torch.float64)).requires_grad_(True)
    labels = torch.randint(0, 50, (3, 8), generator=g)
    weights = torch.randn(3, 8, generator=g, dtype=torch.float64)
    logp, ent = models.token_logprobs(base[:, :-1], labels, temperature, True)  # a strided view
    (logp.double() * weights).sum().backward()
    got = base.grad.clone()
    base.grad = None
    ref_all = torch.log_softmax(base[:, :-1] / temperature, -1)
    ref = ref_all.gather(-1, labels[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    torch.testing.assert_close(logp.double(), ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(ref_all.exp() * ref_all).sum(-1).detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, base.grad, rtol=0, atol=1e-5)
    assert got[:, -1].abs().max() == 0 and got.abs().max() > 0.1


def test_a_rollout_smaller_than_configured_trains_every_sample():
    """Dynamic sampling may keep fewer groups than configured: 6 samples with mini-batches of 4 make two
    optimizer steps (4 + 2), no sample left out."""
    from rlcore.trainer.update import ppo_update

    model = tiny_causal_lm("qwen2")
    exp = _experience(model, batch=6, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    seen = []
    real = actor_micro_loss

    def counting(actor, mb, *args, **kwargs):
        seen.append(mb.input_ids.shape[0])
        return real(actor, mb, *args, **kwargs)

    import rlcore.trainer.update as update

    update.actor_micro_loss, saved = counting, update.actor_micro_loss
    try:
        out = ppo_update(exp, actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=0.0,
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4), grad_accum=1, temperature=1.0,
                         kl_loss_coef=0.0)
    finally:
        update.actor_micro_loss = saved
    assert sum(seen) == 6 and sorted(seen) == [2, 4]
    assert out["actor/optimizer_steps"] == 2


def test_the_padding_share_of_the_micro_batches_is_reported():
    """``actor/padding_frac``: the share of the token positions the update computes that are padding,
    counted as the forward runs them (rows moved left: rows x the longest row; packed: none)."""
    from rlcore.trainer import aligned
    from rlcore.trainer.update import _host_sizes, _padding_share, ppo_update

    model = tiny_causal_lm("qwen2")
    exp = _experience(model, batch=4, prompt=5, response=6)
    exp.attention_mask[1, -2:] = 0  # its early-stopped response attends to no padding
    # sample 0: 3 prompt + 6 response tokens; sample 1: 5 + 4; samples 2, 3: 5 + 6 (11 columns)
    sizes = _host_sizes(exp)
    assert sizes[0].tolist() == [3, 5, 5, 5] and sizes[1].tolist() == [6, 4, 6, 6] and sizes[2] == 11
    groups = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    real = 9 + 9 + 11 + 11
    assert aligned.ENABLED  # the default forward: each micro-batch as wide as its longest row
    assert _padding_share(groups, sizes, packed=False, trim=True) == pytest.approx(1 - real / (2 * 9 + 2 * 11))
    assert _padding_share([torch.tensor([0, 2])], sizes, packed=False, trim=True) == pytest.approx(1 - 20 / 22)
    assert _padding_share(groups, sizes, packed=True, trim=True) == 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    out = ppo_update(exp, actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=0.0,
                     ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2), grad_accum=1, temperature=1.0,
                     kl_loss_coef=0.0)
    assert 0.0 <= out["actor/padding_frac"] < 1.0
    # grouped by length, the two 11-token rows share a micro-batch and the two 9-token rows the other
    assert out["actor/padding_frac"] == pytest.approx(0.0)


def test_micro_batch_metrics_stay_on_the_device_until_read_together():
    """A micro-batch's losses and fractions are kept as detached tensors (reading each would make the host
    wait for that backward before queuing the next micro-batch); host_stats reads them all to floats
    with their values and order, floats passing through."""
    from rlcore.trainer.update import host_stats

    model = tiny_causal_lm("qwen2")
    exp = _experience(model)
    stats = defaultdict(list)
    actor_micro_loss(model, exp, PPOConfig(), temperature=1.0, kl_loss_coef=0.0, weight=1.0, stats=stats)
    assert {"loss/policy", "entropy/mean", "actor/clipfrac", "actor/approx_kl"} <= set(stats)
    kept = {k: v[0] for k, v in stats.items()}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in kept.values())
    stats["loss/policy"].append(torch.tensor(float("nan")))
    stats["plain"] = [2.5, torch.tensor(3, dtype=torch.int64)]
    read = host_stats(stats)
    assert read["plain"] == [2.5, 3.0] and math.isnan(read["loss/policy"][1])
    for k, v in kept.items():
        assert read[k][0] == float(v) and type(read[k][0]) is float


def test_the_update_seconds_cover_all_of_its_work(monkeypatch):
    """``time/update_actor_s`` is the update's whole time, its planning and index copies included (not
    only the spans around each micro-batch's call): with a clock that moves only while the update plans
    its micro-batches and copies their indices, the update reports exactly that time."""
    import rlcore.trainer.update as update

    model = tiny_causal_lm("qwen2")
    exp = _experience(model, batch=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    now = {"t": 100.0}

    class Clock:
        @staticmethod
        def perf_counter():
            return now["t"]

    plan, to = update._plan, torch.Tensor.to

    def slow_plan(*args, **kwargs):
        now["t"] += 3.0
        return plan(*args, **kwargs)

    def slow_to(self, *args, **kwargs):  # the micro-batches' index copies
        if self.dtype == torch.long and self.dim() == 1:
            now["t"] += 0.5
        return to(self, *args, **kwargs)

    monkeypatch.setattr(update, "time", Clock)
    monkeypatch.setattr(update, "_plan", slow_plan)
    monkeypatch.setattr(torch.Tensor, "to", slow_to)
    out = update.ppo_update(exp, actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=0.0,
                            ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2), grad_accum=1, temperature=1.0,
                            kl_loss_coef=0.0)
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert out["actor/micro_batches"] == 2.0
    copies = (now["t"] - 100.0 - 3.0) / 0.5
    assert copies >= 2  # at least each micro-batch's indices
    assert out["time/update_actor_s"] == pytest.approx(now["t"] - 100.0)
