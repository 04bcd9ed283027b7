"""``gradient_checkpointing=auto`` plans by the activation memory it measured, not only the shape's estimate."""

import contextlib
import math

import pytest

import torch

from rlcore.distributed.fsdp import enable_gradient_checkpointing
from rlcore.observe import peak
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import recompute


def _policy(logits=True):
    model = tiny_causal_lm("qwen2")
    enable_gradient_checkpointing(model)
    return recompute.Recompute(model, "auto", model.config, torch.device("cpu"), logits=logits), model


def test_a_measured_rate_replaces_the_estimate_from_the_largest_micro_batch(monkeypatch):
    policy, model = _policy()
    estimate = policy.bytes_per_token
    assert estimate == recompute.activation_bytes_per_token(model.config, torch.float32)
    big = recompute.MEASURE_MIN_TOKENS
    policy.observe(big // 2, int(big // 2 * estimate / 10))  # too few tokens: fixed costs would dominate
    assert policy.bytes_per_token == estimate
    policy.observe(big, int(big * estimate / 2))
    assert policy.bytes_per_token == estimate / 2 * recompute.MARGIN
    policy.observe(big, int(big * estimate / 4))  # the same size, a lower rate: the higher one is kept
    assert policy.bytes_per_token == estimate / 2 * recompute.MARGIN
    policy.observe(2 * big, int(2 * big * estimate * 2 / 3))  # a larger micro-batch sets the rate, even if higher
    assert abs(policy.bytes_per_token - estimate * 2 / 3 * recompute.MARGIN) < 1e-6 * estimate
    policy.observe(big, int(big * estimate / 8))  # a smaller one no longer does
    assert abs(policy.bytes_per_token - estimate * 2 / 3 * recompute.MARGIN) < 1e-6 * estimate


def test_decisions_and_the_budget_follow_the_measured_rate(monkeypatch):
    policy, _ = _policy(logits=False)
    estimate = policy.bytes_per_token
    tokens = 4 * recompute.MEASURE_MIN_TOKENS
    free = int(tokens * estimate * 0.7)  # by the estimate, `tokens` would not fit
    monkeypatch.setattr(recompute, "free_bytes", lambda device: free)
    assert policy.needed(tokens)
    lowered = policy.token_budget(8 * tokens)
    assert recompute.MIN_BUDGET <= lowered < tokens

    def measuring(added):  # a stand-in for the CUDA allocator's figures
        @contextlib.contextmanager
        def window(device):
            out = peak.Window(base=1000)
            yield out
            out.peak = 1000 + added
        return window

    # a micro-batch run without checkpointing measures half the estimate per token
    monkeypatch.setattr(peak, "window", measuring(int(lowered * estimate / 2)))
    layer = policy.layers[0]
    with policy.for_tokens(lowered):
        assert not layer.gradient_checkpointing
    assert policy.measured_tokens == lowered
    assert not policy.needed(tokens)  # 0.5 x 1.15 of the estimate fits in 0.9 x 0.7 of it
    assert policy.token_budget(8 * tokens) > tokens
    metrics = policy.take_metrics()
    assert metrics["actor/recompute_frac"] == 0.0
    assert abs(metrics["actor/activation_mb_per_token"] - estimate / 2 * recompute.MARGIN / 1e6) < 1e-3


def test_a_recomputed_micro_batch_measures_nothing(monkeypatch):
    policy, _ = _policy()
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 0)
    calls = []

    @contextlib.contextmanager
    def window(device):
        calls.append(device)
        yield peak.Window(base=0, peak=10**12)

    monkeypatch.setattr(peak, "window", window)
    with policy.for_tokens(4 * recompute.MEASURE_MIN_TOKENS):
        assert policy.layers[0].gradient_checkpointing
    assert calls == [] and policy.measured_tokens == 0


def test_the_window_off_cuda_measures_nothing_and_keeps_no_peak():
    with peak.window("cpu") as w:
        torch.ones(1000)
    assert w.base is None and w.peak is None and w.above_base is None
    assert peak.max_allocated("cpu") == 0


def test_the_first_update_measures_and_the_next_one_plans_with_the_measured_rate(monkeypatch):
    """Two updates through ``ppo_update``: the first cuts by the shape's estimate and measures its micro-batches,
    the second cuts by the measured rate (larger micro-batches); both give the whole batch's gradient."""
    from test_trainer_packing import _close, _experience, _step

    model = tiny_causal_lm("qwen2")
    enable_gradient_checkpointing(model)
    exp = _experience(model, None, seed=8, packed=False)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 1 << 40)
    _, whole, _ = _step(model, None, exp, packed=True, max_tokens_per_micro_batch=10_000)

    estimate = recompute.activation_bytes_per_token(model.config, torch.float32, logits=False)
    monkeypatch.setattr(recompute, "MIN_BUDGET", 8)
    monkeypatch.setattr(recompute, "MEASURE_MIN_TOKENS", 8)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # allocated by each update's first backward
    monkeypatch.setattr(recompute, "free_bytes", lambda device: int((24 * estimate + grads) / recompute.FREE_SHARE) + 1)
    seen = []

    @contextlib.contextmanager
    def window(device):  # the allocator's figures: a third of the estimate per token
        out = peak.Window(base=0)
        yield out
        out.peak = int(seen[-1] * estimate / 3)

    monkeypatch.setattr(peak, "window", window)
    plain_for_tokens = recompute.Recompute.for_tokens

    def for_tokens(self, tokens):
        seen.append(tokens)
        return plain_for_tokens(self, tokens)

    monkeypatch.setattr(recompute.Recompute, "for_tokens", for_tokens)
    policy = {}

    def policies(roles):  # one policy across both updates, as the trainer keeps it
        if not policy:
            # planned as for the fused head (no logits row a token): the budget is lowered to what fits
            policy["actor"] = recompute.Recompute(roles["actor"], "auto", model.config, torch.device("cpu"),
                                                  logits=False)
        return policy

    first_m, first, _ = _step(model, None, exp, packed=True, recompute_policies=policies,
                              max_tokens_per_micro_batch=10_000)
    assert first_m["actor/micro_batch_token_budget"] == 24
    assert policy["actor"].take_metrics()["actor/recompute_frac"] == 0.0
    assert policy["actor"].measured_tokens > 0
    second_m, second, _ = _step(model, None, exp, packed=True, recompute_policies=policies,
                                max_tokens_per_micro_batch=10_000)
    rate = policy["actor"].bytes_per_token
    assert rate < estimate / 2
    assert second_m["actor/micro_batch_token_budget"] == int(24 * estimate / rate) // 8 * 8 > 24
    assert second_m["actor/micro_batches"] < first_m["actor/micro_batches"]
    assert policy["actor"].take_metrics()["actor/recompute_frac"] == 0.0
    _close(first, whole)
    _close(second, whole)


def _flags(policy, tokens):
    with policy.for_tokens(tokens):
        return [layer.gradient_checkpointing for layer in policy.layers]


def test_a_micro_batch_a_little_too_large_checkpoints_only_the_layers_it_needs(monkeypatch):
    model = tiny_causal_lm("qwen2", num_hidden_layers=8)
    enable_gradient_checkpointing(model)
    policy = recompute.Recompute(model, "auto", model.config, torch.device("cpu"))
    rate = policy.bytes_per_token
    per_layer = rate * policy.layer_share / 8  # what checkpointing one layer gives back, a token
    assert 0 < policy.layer_share < 1  # the logits row is not a layer's
    tokens = 1000
    # the micro-batch overshoots the usable memory by a layer's worth
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    usable = tokens * rate - tokens * per_layer
    free = (usable + grads) / recompute.FREE_SHARE
    monkeypatch.setattr(recompute, "free_bytes", lambda device: free)
    assert policy.usable_bytes() == pytest.approx(usable)
    assert policy.layers_needed(tokens) == 8  # at the shape's estimate: every layer
    # once measured (here: the estimate's rate), a partial plan fills only PARTIAL_SHARE of the usable memory:
    # a few layers checkpoint, the first ones
    policy.observe(recompute.MEASURE_MIN_TOKENS, int(recompute.MEASURE_MIN_TOKENS * rate / recompute.MARGIN))
    assert policy.bytes_per_token == pytest.approx(rate)
    expected = math.ceil((tokens * rate - recompute.PARTIAL_SHARE * usable) / (tokens * per_layer))
    assert 1 < expected < 8 and policy.layers_needed(tokens) == expected
    assert _flags(policy, tokens) == [True] * expected + [False] * (8 - expected)
    assert not any(layer.gradient_checkpointing for layer in policy.layers)  # off again after the micro-batch
    assert _flags(policy, tokens // 2) == [False] * 8  # half the tokens fit
    # more than the layers can give back (the logits row stays): every layer
    monkeypatch.setattr(recompute, "free_bytes", lambda device: tokens * rate * (1 - policy.layer_share) / 2)
    assert _flags(policy, tokens) == [True] * 8
    assert policy.take_metrics()["actor/recompute_frac"] == pytest.approx((expected / 8 + 0 + 1) / 3)
    # selective checkpointing gives back less a layer: more layers for the same excess
    selective = recompute.Recompute(model, "auto", model.config, torch.device("cpu"), selective=True)
    selective.observe(recompute.MEASURE_MIN_TOKENS, int(recompute.MEASURE_MIN_TOKENS * rate / recompute.MARGIN))
    monkeypatch.setattr(recompute, "free_bytes", lambda device: free)
    assert expected < selective.layers_needed(tokens) <= 8
    # partial=False: all layers or none, as before
    whole = recompute.Recompute(model, "auto", model.config, torch.device("cpu"), partial=False)
    whole.observe(recompute.MEASURE_MIN_TOKENS, int(recompute.MEASURE_MIN_TOKENS * rate / recompute.MARGIN))
    assert _flags(whole, tokens) == [True] * 8 and _flags(whole, tokens // 2) == [False] * 8


def test_a_partly_checkpointed_update_has_the_gradients_of_none(monkeypatch):
    from rlcore.rlmath import masked_mean

    def gradients(count):
        model = tiny_causal_lm("qwen2", num_hidden_layers=4, seed=3)
        enable_gradient_checkpointing(model)
        policy = recompute.Recompute(model, "auto", model.config, torch.device("cpu"))
        model.train()
        monkeypatch.setattr(policy, "layers_needed", lambda tokens: count)
        runs = [0] * 4
        for i, layer in enumerate(policy.layers):
            layer.mlp.register_forward_pre_hook(lambda *a, i=i: runs.__setitem__(i, runs[i] + 1))
        ids = torch.randint(1, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
        with policy.for_tokens(ids.numel()):
            logits = model(input_ids=ids).logits
            loss = masked_mean(torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0],
                               torch.ones(3, 23))
            loss.backward()
        assert runs == [2] * count + [1] * (4 - count)  # the checkpointed layers ran their forward again
        return [p.grad.clone() for p in model.parameters()]

    none, some, every = gradients(0), gradients(2), gradients(4)
    for a, b, c in zip(none, some, every):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_a_run_checkpointing_some_layers_trains_like_one_without(tmp_path, monkeypatch, compiled):
    """``auto`` with every micro-batch checkpointing one of its two layers (compiled layers too: the
    layers then run with different switches) gives the metrics of a run without checkpointing."""
    from test_recompute_selective import two_demo_steps

    plain = two_demo_steps(tmp_path / "plain", compiled, "actor.gradient_checkpointing=false",
                           "critic.gradient_checkpointing=false")
    monkeypatch.setattr(recompute.Recompute, "layers_needed", lambda self, tokens: 1)
    some = two_demo_steps(tmp_path / "some", compiled, "actor.gradient_checkpointing=auto",
                          "critic.gradient_checkpointing=auto")
    for p, s in zip(plain, some):
        assert s["actor/recompute_frac"] == 0.5
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm", "reward/mean"):
            assert s[key] == pytest.approx(p[key], rel=1e-4, abs=1e-5), key


def _auto(holder):
    def policies(roles):  # one policy for the update, kept to read its metrics
        holder["actor"] = recompute.Recompute(roles["actor"], "auto", roles["actor"].config, torch.device("cpu"))
        return holder
    return policies


def test_a_micro_batch_out_of_memory_before_its_gradient_runs_again_with_every_layer_checkpointed(monkeypatch):
    from test_trainer_packing import _close, _experience, _step

    from rlcore.trainer import update

    model = tiny_causal_lm("qwen2")
    enable_gradient_checkpointing(model)
    exp = _experience(model, None, seed=8, packed=False)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 1 << 40)  # everything fits: no checkpointing
    plain_m, plain, _ = _step(model, None, exp, packed=False, micro_batch_size=4)
    real, seen = update.actor_micro_loss, []

    def short_of_memory_once(actor, *args, **kwargs):
        seen.append([layer.gradient_checkpointing for layer in recompute.switchable_layers(actor)])
        if len(seen) == 2:  # the second micro-batch, before anything of it reached .grad
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return real(actor, *args, **kwargs)

    monkeypatch.setattr(update, "actor_micro_loss", short_of_memory_once)
    holder = {}
    got_m, got, _ = _step(model, None, exp, packed=False, micro_batch_size=4, recompute_policies=_auto(holder))
    assert seen[1] == [False, False] and seen[2] == [True, True]  # the retry checkpoints every layer
    assert all(flags == [False, False] for flags in seen[3:])  # the later ones fit: none
    policy = holder["actor"]
    assert not policy.partial and policy.oom_tokens > 0
    assert policy.layers_needed(policy.oom_tokens) == len(policy.layers)  # as large a one checkpoints from now on
    assert policy.layers_needed(policy.oom_tokens - 1) == 0
    metrics = policy.take_metrics()
    assert metrics["actor/recompute_oom_retries"] == 1.0
    assert metrics["actor/recompute_frac"] == pytest.approx(1 / (len(seen) - 1))  # the failed try not counted
    _close(got, plain)  # the same gradient: the failed try added nothing
    for key in ("loss/policy", "actor/clipfrac"):
        assert got_m[key] == pytest.approx(plain_m[key], rel=1e-5), key


@pytest.mark.parametrize("case", ["after its gradient", "every layer checkpointed"])
def test_an_out_of_memory_error_that_cannot_be_retried_is_raised(monkeypatch, case):
    from test_trainer_packing import _experience, _step

    from rlcore.trainer import update

    model = tiny_causal_lm("qwen2")
    enable_gradient_checkpointing(model)
    exp = _experience(model, None, seed=8, packed=False)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 1 << 40 if case == "after its gradient" else 0)
    real = update.actor_micro_loss

    def short_of_memory(actor, *args, **kwargs):
        if case == "after its gradient":
            real(actor, *args, **kwargs)  # its backward accumulated into .grad
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(update, "actor_micro_loss", short_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="a stand-in"):
        _step(model, None, exp, packed=False, micro_batch_size=4, recompute_policies=_auto({}))


def test_sharded_parameters_are_not_retried():
    """Parameters a sharding wrapper owns (DTensors: it writes their .grad itself, past the hooks) give no retry."""
    model = tiny_causal_lm("qwen2")
    enable_gradient_checkpointing(model)
    assert recompute.Recompute(model, "auto", model.config, torch.device("cpu")).retriable
    next(model.parameters())._local_tensor = torch.zeros(1)  # what a DTensor carries
    policy = recompute.Recompute(model, "auto", model.config, torch.device("cpu"))
    assert not policy.retriable
    with policy.for_tokens(8):
        pass
    assert not policy.retry_after_oom(policy.accumulations)
