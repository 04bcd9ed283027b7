"""The overlapped update (``ppo.overlap_update``): micro-batches trained during the rollout with a
provisional weight give, once rescaled, the update of the whole rollout; the trainer with it on trains
as with it off, the same in every run; failures in its worker surface or fall back."""

from __future__ import annotations

import copy
import logging
import threading
from collections import defaultdict

import pytest
import torch

from rlcore.config.schema import PPOConfig
from rlcore.rollout.base import RolloutBatch
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import overlap
from rlcore.trainer.experience import Experience, to_experience
from rlcore.trainer.update import (
    Accumulated,
    actor_micro_step,
    ppo_update,
    provisional_total,
    share_counts,
)

# --------------------------------------------------------------------------------------- ppo_update(pre=...)


def _experience(seed: int = 0, samples: int = 8, prompt: int = 4, response: int = 6) -> Experience:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (samples, prompt + response), generator=g)
    mask = torch.ones(samples, prompt + response, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded prompt
    lengths = torch.randint(1, response + 1, (samples,), generator=g)
    resp = (torch.arange(response)[None] < lengths[:, None]).float()
    mask[:, prompt:] = resp.long()
    adv = torch.randn(samples, generator=g)[:, None].expand(-1, response) * resp
    return Experience(input_ids=ids, attention_mask=mask, response_mask=resp, old_logprobs=None,
                      scores=torch.zeros(samples), advantages=adv.contiguous(),
                      rollout_logprobs=torch.zeros(samples, response))


def _optim(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (Adam would blow up the float noise of zero gradients)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _update(model, exp, ppo, pre=None):
    opt, sched = _optim(model)
    return ppo_update(exp, actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=1.0, ppo=ppo, grad_accum=1,
                      temperature=1.0, kl_loss_coef=0.0, generator=torch.Generator().manual_seed(3), pre=pre)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_pre_accumulated_micro_batches_rescaled_give_the_whole_update(loss_agg):
    ppo = PPOConfig(micro_batch_size=3, loss_agg=loss_agg)
    exp = _experience()
    plain, pre_model = tiny_causal_lm("qwen2"), None
    pre_model = copy.deepcopy(plain)
    expected = _update(plain, exp, ppo)

    acc = Accumulated()
    denominator = provisional_total(exp.size, ppo.generation.max_new_tokens, loss_agg)
    pre_model.train()
    for group in (torch.tensor([5, 1]), torch.tensor([7, 0, 2])):  # any cut, any order
        weight = share_counts(exp.response_mask, [group], loss_agg)[0] / denominator
        stats = defaultdict(list)
        _, logp = actor_micro_step(pre_model, exp, group, weight, stats, ppo=ppo, temperature=1.0, kl_loss_coef=0.0,
                                   packed=False, recompute={})
        acc.groups.append(group)
        acc.provisional.append(weight)
        acc.logprobs.append(logp.detach())
        for k, v in stats.items():
            acc.stats[k].extend(v)
    got = _update(pre_model, exp, ppo, pre=acc)

    for (name, a), b in zip(plain.named_parameters(), pre_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
    for key in ("loss/policy", "entropy/mean", "actor/clipfrac", "actor/approx_kl", "actor/grad_norm",
                "rollout/logprob_abs_diff_mean", "actor/optimizer_steps"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    # the 2 done micro-batches, then one of the 3 samples left
    assert got["actor/micro_batches"] == 3.0 and expected["actor/micro_batches"] == 3.0


def test_pre_accumulated_micro_batches_need_one_step_over_the_rollout():
    exp = _experience()
    acc = Accumulated(groups=[torch.tensor([0])], provisional=[1.0])
    with pytest.raises(ValueError, match="one optimizer step"):
        _update(tiny_causal_lm("qwen2"), exp, PPOConfig(ppo_epochs=2), pre=acc)


# --------------------------------------------------------------------------------------- the worker, alone

N, WIDTH = 2, 4
PROMPTS = [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5], [6], [6]]


class Scorer:
    """Scores each sample with its length (a finished future per call)."""

    def __init__(self):
        from concurrent.futures import Future

        self.future = Future

    def __call__(self, indices, responses):
        f = self.future()
        f.set_result((["" for _ in indices], torch.tensor([float(len(r)) for r in responses]), {}))
        return f


def _worker(model, train, micro=2, scorer=None):
    def prepare(rollout: RolloutBatch, raw, group):
        exp = to_experience(rollout, raw, torch.device("cpu"))
        exp.old_logprobs, exp.advantages = None, exp.response_mask * (raw - raw.mean())[:, None]
        return exp

    plan = overlap.Plan(micro=micro, budget=0, packed=False, by_length=True, loss_agg="token-mean",
                        denominator=float(len(PROMPTS) * WIDTH))
    return overlap.OverlapUpdate(scorer or Scorer(), PROMPTS, N, prepare=prepare, train=train, plan=plan, width=WIDTH,
                                 pad_token_id=0, model=model, device=torch.device("cpu"))


def _grad_train(model, fail_at=None, error=None):
    calls = []

    def train(exp, idx, weight, stats, k):
        calls.append(idx.tolist())
        if fail_at is not None and len(calls) == fail_at:
            raise error
        loss = model(exp.input_ids[idx].float()).sum() * weight
        loss.backward()
        stats["loss/policy"].append(float(loss.detach()))
        return torch.zeros(len(idx), WIDTH)

    return train, calls


def _final(responses):
    ids = torch.zeros(len(responses), WIDTH, dtype=torch.long)
    mask = torch.zeros(len(responses), WIDTH, dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask,
                        logprobs=torch.zeros(len(responses), WIDTH))


RESPONSES = [[7, 8], [9], [7, 7, 7], [8, 8], [9, 9, 9, 9], [5]]


def test_worker_trains_complete_groups_in_decode_order_and_leaves_the_open_micro_batch():
    model = torch.nn.Linear(3 + WIDTH, 1)  # input: a row of ids (prompt width 3 + response width 4)
    train, calls = _grad_train(model)
    work = _worker(model, train, micro=2)
    try:
        work([4, 0], [RESPONSES[4], RESPONSES[0]])  # no group complete yet
        work([2, 3, 1], [RESPONSES[2], RESPONSES[3], RESPONSES[1]])  # group 1 completes, then group 0
        work([5], [RESPONSES[5]])  # group 2
        acc, metrics = work.finish(_final(RESPONSES))
    finally:
        work.close()
    # group 1 ({2, 3}) came first: one closed micro-batch of 2; then group 0 and group 2 close two more
    assert [sorted(g.tolist()) for g in acc.groups][0] == [2, 3]
    assert sorted(torch.cat(acc.groups).tolist()) == list(range(6))
    assert metrics["update/overlapped_frac"] == 1.0 and metrics["update/overlap_oom"] == 0.0
    assert all(p.grad is not None for p in model.parameters())


def _wait_for(condition, timeout=20.0):
    import time

    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    assert condition()


def test_an_error_in_the_worker_surfaces_in_the_trainers_thread():
    model = torch.nn.Linear(3 + WIDTH, 1)
    train, calls = _grad_train(model, fail_at=2, error=ValueError("broken micro-batch"))
    work = _worker(model, train)
    try:
        work([0, 1, 2, 3], RESPONSES[:4])  # the first micro-batch trains, the second fails
        _wait_for(lambda: len(calls) == 2)
        _wait_for(lambda: any(p.grad is not None for p in model.parameters()))
        with pytest.raises(ValueError, match="broken micro-batch"):
            _wait_for(lambda: work._error is not None)
            work([4, 5], RESPONSES[4:])  # the next report raises it: the rollout stops
    finally:
        work.close()
    assert all(p.grad is None for p in model.parameters())  # nothing half-accumulated is kept
    work = _worker(model, _grad_train(model, fail_at=1, error=ValueError("at the end"))[0])
    try:
        work([0, 1], RESPONSES[:2])
        with pytest.raises(ValueError, match="at the end"):
            work.finish(_final(RESPONSES))
    finally:
        work.close()


def test_out_of_memory_in_the_worker_leaves_every_sample_to_the_update(caplog):
    model = torch.nn.Linear(3 + WIDTH, 1)
    train, calls = _grad_train(model, fail_at=2, error=torch.OutOfMemoryError("CUDA out of memory (test)"))
    work = _worker(model, train)
    with caplog.at_level(logging.WARNING, logger="rlcore.trainer.overlap"):
        try:
            work([0, 1, 2, 3], RESPONSES[:4])  # the first micro-batch trains, the second runs out of memory
            work([4, 5], RESPONSES[4:])
            acc, metrics = work.finish(_final(RESPONSES))
        finally:
            work.close()
    assert len(calls) == 2 and acc.groups == []
    assert metrics["update/overlap_oom"] == 1.0 and metrics["update/overlapped_frac"] == 0.0
    assert all(p.grad is None for p in model.parameters())  # the first micro-batch's gradient is dropped too
    assert "out of memory" in caplog.text


def test_a_sample_whose_final_tokens_changed_drops_the_overlapped_work():
    model = torch.nn.Linear(3 + WIDTH, 1)
    work = _worker(model, _grad_train(model)[0])
    try:
        work([0, 1], [[9, 9], RESPONSES[1]])  # reported, then sampled again (a retried chunk)
        acc, metrics = work.finish(_final(RESPONSES))
    finally:
        work.close()
    assert acc.groups == [] and metrics["update/overlap_discarded"] == 1.0
    assert all(p.grad is None for p in model.parameters())


def test_a_stalled_worker_does_not_hang_the_trainer(monkeypatch):
    from rlcore.errors import TrainingError

    monkeypatch.setattr(overlap, "STALL_S", 0.5)
    release = threading.Event()
    model = torch.nn.Linear(3 + WIDTH, 1)

    def train(exp, idx, weight, stats, k):
        release.wait(20)
        return torch.zeros(len(idx), WIDTH)

    work = _worker(model, train)
    try:
        work([0, 1], RESPONSES[:2])
        with pytest.raises(TrainingError, match="no progress"):
            work.finish(_final(RESPONSES))
    finally:
        release.set()
        work.close()


def test_closing_stops_a_worker_that_waits_for_scores():
    import time
    from concurrent.futures import Future

    model = torch.nn.Linear(3 + WIDTH, 1)
    train, calls = _grad_train(model)
    work = _worker(model, train, scorer=lambda indices, responses: Future())  # scores that never come
    work([0, 1], RESPONSES[:2])
    t0 = time.monotonic()
    work.close()
    assert not work._thread.is_alive() and time.monotonic() - t0 < 5 and calls == []


# --------------------------------------------------------------------------------------- the trainer


GRPO = ("algorithm.adv_estimator=grpo", "ppo.ppo_epochs=1", "ppo.mini_batch_size=0", "ppo.kl_coeff=0",
        "ppo.generation.max_new_tokens=12", "ppo.rollout_batch_size=8", "trainer.max_steps=2",
        "trainer.eval_samples=0")


def train(tmp_path, *overrides):
    from rlcore.testing import train_demo

    trainer, metrics, _ = train_demo(tmp_path, "trainer.progress=false", "trainer.gpu_monitor=false",
                                     "trainer.export_final=false", "plugins=[]", *GRPO, *overrides)
    return trainer, metrics


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.c.actor.model.named_parameters()}


STEP_METRICS = ("loss/policy", "entropy/mean", "actor/clipfrac", "actor/approx_kl", "actor/grad_norm",
                "actor/micro_batches", "actor/optimizer_steps", "rollout/logprob_abs_diff_mean")
# micro-batches of 5 samples from 32, token shares per micro-batch and shaped scores: some groups train
# during the rollout, the open micro-batch after it
SETTINGS = ("ppo.micro_batch_size=5", "ppo.loss_agg=seq-mean-token-mean", "algorithm.mask_truncated=true",
            "algorithm.overlong_buffer.length=4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    return {name: train(root / name, f"ppo.overlap_update={on}", *SETTINGS)
            for name, on in (("off", "false"), ("on", "true"))}


def test_the_overlapped_update_trains_as_the_update_after_the_rollout(runs):
    (off, m_off), (on, m_on) = runs["off"], runs["on"]
    assert all("rollout/kv_bytes_peak" in m for m in m_off.values())  # the rollout engine (paged) generated
    for step in m_off:
        assert 0.5 < m_on[step]["update/overlapped_frac"] < 1.0  # most samples trained during the rollout
        assert m_on[step]["update/overlap_oom"] == 0.0 and m_on[step]["time/update_overlap_s"] > 0
        assert "update/overlapped_frac" not in m_off[step]
        for key in STEP_METRICS:
            assert m_on[step][key] == pytest.approx(m_off[step][key], rel=1e-4, abs=1e-6), (step, key)
    w_off, w_on = _weights(off), _weights(on)
    for name in w_off:
        assert torch.allclose(w_off[name], w_on[name], atol=1e-5, rtol=1e-4), name


def test_two_overlapped_runs_with_one_seed_are_bit_identical(runs, tmp_path):
    on, m_on = runs["on"]
    again, m_again = train(tmp_path, "ppo.overlap_update=true", *SETTINGS)
    assert all(torch.equal(a, b) for a, b in zip(_weights(on).values(), _weights(again).values()))
    for step in m_on:
        for key in (*STEP_METRICS, "update/overlapped_frac"):
            assert m_on[step][key] == m_again[step][key], (step, key)


def test_an_out_of_memory_error_in_the_worker_falls_back_to_the_update(runs, tmp_path, monkeypatch):
    import rlcore.trainer.update as update

    plain = update.actor_micro_step
    failed = []

    def flaky(*args, **kwargs):
        if threading.current_thread().name == "rlcore-overlap-update" and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return plain(*args, **kwargs)

    monkeypatch.setattr(update, "actor_micro_step", flaky)
    fell_back, metrics = train(tmp_path, "ppo.overlap_update=true", *SETTINGS)
    assert metrics[1]["update/overlap_oom"] == 1.0 and metrics[1]["update/overlapped_frac"] == 0.0
    assert metrics[2]["update/overlap_oom"] == 0.0 and metrics[2]["update/overlapped_frac"] > 0
    off, _ = runs["off"]
    for (name, a), b in zip(_weights(off).items(), _weights(fell_back).values()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), name


def test_an_ineligible_step_says_why_once_and_runs_the_update_after_the_rollout(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlcore.trainer.overlap"):
        _, metrics = train(tmp_path, "ppo.overlap_update=true", "ppo.ppo_epochs=2", "trainer.max_steps=2")
    assert [r.getMessage() for r in caplog.records].count(
        "ppo.overlap_update=true, but the update runs after the rollout: the update is not one optimizer step over "
        "the rollout (ppo.ppo_epochs=1 and one mini-batch are needed)") == 1
    assert all(m["update/overlapped_frac"] == 0.0 for m in metrics.values())
