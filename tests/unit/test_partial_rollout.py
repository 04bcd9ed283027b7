"""Partial rollouts (``ppo.partial_rollout.segment``): a segment as long as the response cap trains as off,
bit for bit; with a short segment every drawn group trains exactly once, as its segments joined (tokens and
rollout log-probs as the backend produced them), at the step its last sample finishes; a resumed run
trains as the uninterrupted one; the config refuses what partial rollouts do not run with."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.hookspecs import hookimpl
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.testing import demo_overrides
from rlcore.trainer.loop import Trainer
from rlcore.trainer.partial import STATE_KEY, CarryState, PartialSource, check_world

MAX_NEW = 12
GRPO = ("algorithm.adv_estimator=grpo", "ppo.ppo_epochs=1", "ppo.mini_batch_size=0", "ppo.kl_coeff=0",
        f"ppo.generation.max_new_tokens={MAX_NEW}", "ppo.rollout_batch_size=8", "trainer.eval_samples=0",
        "ppo.rollout_is=token", "trainer.progress=false", "trainer.gpu_monitor=false", "trainer.export_final=false",
        "plugins=[]")
METRICS = ("partial/groups_trained", "partial/samples_carried", "partial/groups_waiting", "partial/stale_token_frac",
           "partial/segments_max")


class Record:
    """What a run drew, generated and trained, step by step."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}
        self.drawn: dict[int, list[tuple[int, ...]]] = {}  # step -> the prompts drawn (one per group)
        self.calls: dict[int, list[tuple]] = {}  # step -> [(prompts, max_new_tokens, RolloutBatch)] of generate
        self.params: dict[int, list] = {}  # step -> the SamplingParams of each generate call
        self.trained: dict[int, object] = {}  # step -> the Sampled the trainer got
        self.buffer: dict[int, list] = {}  # step -> (prompt, [(tokens, segments, done)]) of each waiting group

    @hookimpl
    def rlcore_step_end(self, step, metrics):
        self.metrics[step] = dict(metrics)


def run(path, *overrides):
    """Train the demo with :data:`GRPO` and ``overrides``; return the trainer and its :class:`Record`."""
    cfg = load_config([], [*demo_overrides(path), *GRPO, *overrides])
    pm = build_plugin_manager([])
    rec = Record()
    pm.register(rec)
    trainer = Trainer(cfg, pm, DistInfo())
    c, step_of = trainer.c, {"now": 0}
    fill, generate, source_next = c.prompts.fill, c.generation.generate, trainer.source.next

    class Filler:  # the batch filler, recording what each step draws
        def __call__(self, rows):
            out = fill(rows)
            rec.drawn.setdefault(step_of["now"], []).extend(tuple(r["input_ids"]) for r in out)
            return out

        def __getattr__(self, name):
            return getattr(fill, name)

    def recording_generate(prompts, params, **kw):
        batch = generate(prompts, params, **kw)
        rec.calls.setdefault(step_of["now"], []).append(([list(p) for p in prompts], params.max_new_tokens, batch))
        rec.params.setdefault(step_of["now"], []).append(params)
        return batch

    def recording_next(step):
        step_of["now"] = step
        out = source_next(step)
        rec.trained[step] = out
        if isinstance(trainer.source, PartialSource):
            rec.buffer[step] = [(tuple(g.prompt), [(list(s.tokens), list(s.segments), s.done) for s in g.samples])
                                for g in trainer.source.groups]
        return out

    c.prompts.fill = Filler()
    c.generation.generate = recording_generate
    trainer.source.next = recording_next
    if isinstance(trainer.source, PartialSource):
        trainer.source.filler = c.prompts.fill
    trainer.train()
    return trainer, rec


def weights(trainer):
    return [p.detach().clone() for p in trainer.c.actor.model.parameters()]


# --------------------------------------------------------------------------------- segment >= max_new_tokens


@pytest.mark.parametrize("segment", [MAX_NEW, MAX_NEW + 5])
def test_a_segment_as_long_as_the_cap_trains_as_off(tmp_path, segment):
    off, r_off = run(tmp_path / "off", "trainer.max_steps=3")
    on, r_on = run(tmp_path / "on", "trainer.max_steps=3", f"ppo.partial_rollout.segment={segment}")
    assert isinstance(on.source, PartialSource) and not isinstance(off.source, PartialSource)
    for step in (1, 2, 3):
        a, b = r_off.trained[step], r_on.trained[step]
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
            assert torch.equal(getattr(a.rollout, name), getattr(b.rollout, name)), (step, name)
        assert torch.equal(a.scores, b.scores) and torch.equal(a.group_ids, b.group_ids)
        assert torch.equal(a.truncated, b.truncated)
        m = r_on.metrics[step]
        assert m["partial/groups_trained"] == 8 and m["partial/groups_waiting"] == 0
        assert m["partial/samples_carried"] == 0 and m["partial/stale_token_frac"] == 0
        assert m["partial/segments_max"] == 1
        assert r_on.metrics[step]["loss/policy"] == r_off.metrics[step]["loss/policy"]
    assert r_off.metrics[1]["response/clip_frac"] > 0  # some samples reached the cap: the segment was the cap
    assert all(torch.equal(a, b) for a, b in zip(weights(off), weights(on)))


# --------------------------------------------------------------------------------- a short segment

SEGMENT, STEPS = 5, 6  # 12 = 5 + 5 + 2: a third segment is cut at the budget left


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    return run(tmp_path_factory.mktemp("partial"), f"trainer.max_steps={STEPS}", f"ppo.partial_rollout.segment={SEGMENT}")


def _chains(rec, eos, pad):
    """Each trained sample traced through the generate calls: ``(train step, prompt, [(step, tokens kept,
    tokens generated)...])``,
    checking on the way that its tokens and log-probs are its segments joined, as the backend produced them."""
    used: set[tuple[int, int, int]] = set()
    traced = []
    for step, batch in rec.trained.items():
        r = batch.rollout
        for i in range(r.batch_size):
            prompt = r.prompt_ids[i][r.prompt_mask[i].bool()].tolist()
            tokens = r.response_ids[i][r.response_mask[i].bool()].tolist()
            logprobs = r.logprobs[i][r.response_mask[i].bool()]
            assert len(tokens) == int(r.response_mask[i].sum()) and r.response_mask[i, :len(tokens)].all()
            assert (r.response_ids[i, len(tokens):] == pad).all() and (r.logprobs[i, len(tokens):] == 0).all()
            k, at, chain = 0, None, []
            while k < len(tokens) or not chain:
                found = None
                for s in sorted(rec.calls):
                    if at is not None and s != at + 1:
                        continue
                    for c, (prompts, asked, gen) in enumerate(rec.calls[s]):
                        for row, p in enumerate(prompts):
                            if (s, c, row) in used or p != prompt + tokens[:k]:
                                continue
                            got = gen.response_ids[row][gen.response_mask[row].bool()].tolist()
                            cut = got[:MAX_NEW - k]
                            if cut == tokens[k:k + len(cut)]:
                                lp = gen.logprobs[row][gen.response_mask[row].bool()][:len(cut)]
                                assert torch.equal(lp, logprobs[k:k + len(cut)])  # the rollout's own log-probs
                                ended_early = gen.cut is not None and bool(gen.cut[row])
                                found = (s, c, row, len(cut), asked, got, ended_early)
                                break
                        if found:
                            break
                    if found or at is not None:
                        break
                assert found is not None, f"trained sample {i} of step {step}: segment at {k} tokens not generated"
                s, c, row, m, asked, got, ended_early = found
                used.add((s, c, row))
                chain.append((s, m, len(got)))
                k, at = k + m, s
                ended = any(t in eos for t in got[:m]) or k >= MAX_NEW or (len(got) < asked and not ended_early)
                assert ended == (k == len(tokens))  # carried exactly while unfinished
            assert k == len(tokens) and chain[-1][0] <= step
            traced.append((step, tuple(prompt), chain))
    return traced, used


def test_every_drawn_group_trains_once_as_its_segments_joined(short):
    trainer, rec = short
    eos = set(trainer.c.eos_ids)
    assert all(all(asked == SEGMENT for _, asked, _ in rec.calls[s]) for s in rec.calls)
    traced, used = _chains(rec, eos, trainer.c.tokenizer.pad_token_id)
    assert any(len(chain) > 1 for _, _, chain in traced)  # samples were carried across steps
    # each sample is asked for its budget left at most (12 = 5 + 5 + 2): the engine stops there, nothing is cut after
    assert all(got == kept for _, _, chain in traced for _, kept, got in chain)
    assert any([kept for _, kept, _ in chain] == [SEGMENT, SEGMENT, MAX_NEW - 2 * SEGMENT] for _, _, chain in traced)
    # every generated row belongs to exactly one trained sample or to a sample still waiting: none lost or repeated
    rows = sum(len(p) for calls in rec.calls.values() for p, _, _ in calls)
    waiting = rec.buffer[STEPS]
    assert rows == len(used) + sum(len(segs) for _, samples in waiting for _, segs, _ in samples)
    # every drawn group trains once or still waits, counted by prompt
    trained_groups = Counter(p for step in rec.trained for p in
                             [tuple(x for x in rec.trained[step].rollout.prompt_ids[j][
                                 rec.trained[step].rollout.prompt_mask[j].bool()].tolist())
                              for j in range(0, rec.trained[step].rollout.batch_size, trainer.n)])
    drawn = Counter(p for prompts in rec.drawn.values() for p in prompts)
    assert sum(drawn.values()) == 8 * STEPS
    assert drawn == trained_groups + Counter(p for p, _ in waiting)
    assert sum(trained_groups.values()) > 0 and waiting


def test_a_group_trains_at_the_step_its_last_sample_finishes(short):
    trainer, rec = short
    traced, _ = _chains(rec, set(trainer.c.eos_ids), trainer.c.tokenizer.pad_token_id)
    n = trainer.n
    for start in range(0, len(traced), n):
        group = traced[start:start + n]
        step = group[0][0]
        assert {g[0] for g in group} == {step} and len({g[1] for g in group}) == 1
        assert max(chain[-1][0] for _, _, chain in group) == step  # its last sample finished at this step
        assert len({chain[0][0] for _, _, chain in group}) == 1  # drawn together
    # a group still waiting has an unfinished sample; its finished samples decode no more
    for step, groups in rec.buffer.items():
        for _, samples in groups:
            assert not all(done for _, _, done in samples)
            for tokens, segs, done in samples:
                assert sum(m for _, m in segs) == len(tokens) and [s for s, _ in segs] == list(
                    range(segs[0][0], segs[0][0] + len(segs)))
                if not done:
                    assert segs[-1][0] == step and len(tokens) < MAX_NEW


def test_the_partial_metrics_match_the_buffer_and_the_trained_samples(short):
    trainer, rec = short
    traced, _ = _chains(rec, set(trainer.c.eos_ids), trainer.c.tokenizer.pad_token_id)
    for step in range(1, STEPS + 1):
        m, batch, groups = rec.metrics[step], rec.trained[step], rec.buffer[step]
        assert all(key in m for key in METRICS)
        assert m["partial/groups_trained"] == batch.rollout.batch_size / trainer.n
        assert m["partial/groups_waiting"] == len(groups)
        assert m["partial/samples_carried"] == sum(not done for _, samples in groups for _, _, done in samples)
        chains = [chain for s, _, chain in traced if s == step]
        tokens = sum(k for chain in chains for _, k, _ in chain)
        stale = sum(k for chain in chains for at, k, _ in chain if at < step)
        assert m["partial/stale_token_frac"] == pytest.approx(stale / tokens if tokens else 0.0)
        assert m["partial/segments_max"] == max((len(chain) for chain in chains), default=0)
    assert rec.metrics[1]["partial/groups_trained"] < 8  # some groups waited at the first step
    assert any(rec.metrics[s]["partial/stale_token_frac"] > 0 for s in rec.metrics)
    assert any(rec.metrics[s]["partial/segments_max"] > 1 for s in rec.metrics)


# --------------------------------------------------------------------------------- the tail cut

TAIL = ("ppo.partial_rollout.tail_rows=16", "actor.rollout_engine.eos_check_interval=2")


@pytest.fixture(scope="module")
def tail(tmp_path_factory):
    return run(tmp_path_factory.mktemp("tail"), f"trainer.max_steps={STEPS}", *TAIL)


def test_the_tail_cut_carries_the_last_samples_into_the_next_step(tail):
    """``tail_rows=16``: each step's generation ends once at most 16 of its samples still decode; those are
    carried (their tokens so far kept, decoded on at the next step) and their groups train when they end."""
    trainer, rec = tail
    eos = set(trainer.c.eos_ids)
    assert all(p.stop_at_rows == 16 and p.max_new_tokens == MAX_NEW for ps in rec.params.values() for p in ps)
    calls = [gen for step in sorted(rec.calls) for _, _, gen in rec.calls[step]]
    cut = [int(gen.cut.sum()) for gen in calls]
    assert all(c <= 16 for c in cut) and sum(c > 0 for c in cut) >= 2  # tails were cut, never more than 16
    for step in range(1, STEPS + 1):
        assert rec.metrics[step]["partial/samples_cut"] == int(rec.calls[step][0][2].cut.sum())
    for gen in calls:  # a cut sample has no end-of-sequence token and is short of the cap
        for row in gen.cut.nonzero().flatten().tolist():
            got = gen.response_ids[row][gen.response_mask[row].bool()].tolist()
            assert 0 < len(got) < MAX_NEW and not eos & set(got)
    traced, used = _chains(rec, eos, trainer.c.tokenizer.pad_token_id)
    assert any(len(chain) > 1 for _, _, chain in traced)  # cut samples went on at a later step and trained
    rows = sum(len(p) for calls in rec.calls.values() for p, _, _ in calls)
    waiting = rec.buffer[STEPS]
    assert rows == len(used) + sum(len(segs) for _, samples in waiting for _, segs, _ in samples)
    drawn = Counter(p for prompts in rec.drawn.values() for p in prompts)
    trained = Counter(tuple(r.rollout.prompt_ids[j][r.rollout.prompt_mask[j].bool()].tolist())
                      for r in rec.trained.values() for j in range(0, r.rollout.batch_size, trainer.n))
    assert drawn == trained + Counter(p for p, _ in waiting)


def test_the_tail_cut_needs_what_a_segment_needs():
    with pytest.raises(ConfigError, match=r"ppo\.partial_rollout\.tail_rows' must be >= 0"):
        load_config([], ["ppo.partial_rollout.tail_rows=-2"])
    with pytest.raises(ConfigError, match=r"ppo\.partial_rollout\.tail_rows' = 8 .*ppo\.rollout_is"):
        load_config([], ["ppo.partial_rollout.tail_rows=8", "ppo.rollout_is=none"])
    cfg = load_config([], ["ppo.partial_rollout.tail_rows=8", "ppo.rollout_is=token"])
    with pytest.raises(ConfigError, match=r"ppo\.partial_rollout\.tail_rows.*job of 2 processes"):
        check_world(cfg, 2)


# --------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("partial", [(f"ppo.partial_rollout.segment={SEGMENT}",),
                                     ("ppo.partial_rollout.segment=3",),  # no group finishes before the checkpoint
                                     TAIL], ids=["segment", "short-segment", "tail"])
def test_a_resumed_run_trains_as_the_uninterrupted_one(tmp_path, partial):
    segment = 3 if partial == ("ppo.partial_rollout.segment=3",) else None
    common = (*partial, "trainer.resume=auto")
    straight, r_straight = run(tmp_path / "straight", *common, "trainer.max_steps=4")
    first, r_first = run(tmp_path / "split", *common, "trainer.max_steps=2", "trainer.save_steps=2")
    assert r_first.metrics[2]["partial/samples_carried"] > 0 and r_first.buffer[2]  # the checkpoint holds a buffer
    if segment == 3:  # the optimizer has not stepped when the checkpoint is written
        assert r_first.metrics[1]["partial/groups_trained"] == r_first.metrics[2]["partial/groups_trained"] == 0
    resumed, r_resumed = run(tmp_path / "split", *common, "trainer.max_steps=4")
    assert sorted(r_resumed.metrics) == [3, 4]
    for step in (3, 4):
        for key in (*METRICS, "loss/policy", "reward/mean"):
            assert r_resumed.metrics[step].get(key) == r_straight.metrics[step].get(key), (step, key)
    assert r_resumed.buffer[4] == r_straight.buffer[4]
    assert any("loss/policy" in r_straight.metrics[step] for step in (3, 4))  # steps 3-4 trained
    assert all(torch.equal(a, b) for a, b in zip(weights(straight), weights(resumed)))


def test_a_checkpoint_without_partial_rollouts_resumes_with_an_empty_buffer(tmp_path):
    run(tmp_path, "trainer.max_steps=1", "trainer.save_steps=1", "trainer.resume=auto")
    resumed, rec = run(tmp_path, "trainer.max_steps=2", f"ppo.partial_rollout.segment={SEGMENT}",
                       "trainer.resume=auto")
    assert sorted(rec.metrics) == [2]
    assert rec.metrics[2]["partial/groups_trained"] < 8  # no group was carried in: only the new ones decoded
    assert [len(p) for p, _, _ in rec.calls[2]] == [8 * resumed.n]


def test_the_carry_state_round_trips_through_a_data_only_checkpoint_file(short, tmp_path):
    trainer, _ = short
    source = trainer.source
    state = CarryState(source).state_dict()
    assert STATE_KEY in state and "epoch" in state and state[STATE_KEY]["groups"]
    torch.save(state, tmp_path / "data.pt")
    loaded = torch.load(tmp_path / "data.pt", weights_only=True)
    before = [(g.prompt, g.extras, [(s.tokens, s.logprobs, s.segments, s.done) for s in g.samples])
              for g in source.groups]
    source.groups = []
    CarryState(source).load_state_dict(loaded)
    after = [(g.prompt, g.extras, [(s.tokens, s.logprobs, s.segments, s.done) for s in g.samples])
             for g in source.groups]
    assert len(after) == len(before) and all(
        a[0] == b[0] and a[1] == b[1] and all(x[0] == y[0] and x[2] == y[2] and x[3] == y[3]
                                              and (x[1] is None and y[1] is None or torch.equal(x[1], y[1]))
                                              for x, y in zip(a[2], b[2]))
        for a, b in zip(after, before))
    bad = {**loaded, STATE_KEY: {"groups": [{**loaded[STATE_KEY]["groups"][0],
                                             "samples": loaded[STATE_KEY]["groups"][0]["samples"][:2]}]}}
    with pytest.raises(ValueError, match="ppo.generation.n"):
        CarryState(source).load_state_dict(bad)


# --------------------------------------------------------------------------------- config checks


@pytest.mark.parametrize("overrides, keys", [
    (["ppo.partial_rollout.segment=-1"], ["ppo.partial_rollout.segment", ">= 0"]),
    (["ppo.partial_rollout.segment=4", "ppo.rollout_is=none"], ["ppo.partial_rollout.segment", "ppo.rollout_is"]),
    (["ppo.partial_rollout.segment=4", "ppo.rollout_is=token", "data.env_key=env"],
     ["ppo.partial_rollout.segment", "data.env_key"]),
    (["ppo.partial_rollout.segment=4", "ppo.rollout_is=token", "algorithm.adv_estimator=grpo",
      "ppo.generation.n=2", "algorithm.dynamic_sampling.enable=true"],
     ["ppo.partial_rollout.segment", "algorithm.dynamic_sampling.enable"]),
    (["ppo.partial_rollout.segment=4", "ppo.rollout_is=sequence", "ppo.overlap_update=true"],
     ["ppo.partial_rollout.segment", "ppo.overlap_update"]),
    (["ppo.partial_rollout.segment=4", "ppo.rollout_is=token", "algorithm.adv_estimator=remax"],
     ["ppo.partial_rollout.segment", "algorithm.adv_estimator"]),
    (["ppo.partial_rollout.segment=4", "ppo.rollout_is=token", "trainer.nproc_per_node=2"],
     ["ppo.partial_rollout.segment", "trainer.nproc_per_node"]),
])
def test_the_config_refuses_what_partial_rollouts_do_not_run_with(overrides, keys):
    with pytest.raises(ConfigError) as error:
        load_config([], overrides)
    assert len(error.value.problems) == 1
    for key in keys:
        assert key in error.value.problems[0]


def test_a_segment_at_or_past_the_cap_and_off_are_valid():
    for segment in ("0", "1", "128", "1000"):
        load_config([], [f"ppo.partial_rollout.segment={segment}", "ppo.rollout_is=token"])
    assert load_config([], ["ppo.rollout_is=none"]).ppo.partial_rollout.segment == 0  # off needs no rollout_is


def test_several_processes_or_a_world_split_are_refused_before_any_model_loads(tmp_path):
    cfg = load_config([], ["ppo.partial_rollout.segment=4", "ppo.rollout_is=token"])
    check_world(cfg, 1)
    with pytest.raises(ConfigError, match=r"ppo\.partial_rollout\.segment.*job of 2 processes"):
        check_world(cfg, 2)

    class Split:
        rollout_ranks = 1

    with pytest.raises(ConfigError, match=r"ppo\.partial_rollout\.segment.*rlcore_world_split"):
        check_world(cfg, 1, (Split(), None))
    off = load_config([], [])
    check_world(off, 4, (Split(), None))  # off: nothing to refuse
    # the trainer checks at build, with its world size, before the models load
    cfg = load_config([], [*demo_overrides(tmp_path), *GRPO, "ppo.partial_rollout.segment=4"])
    with pytest.raises(ConfigError, match="job of 2 processes"):
        Trainer(cfg, build_plugin_manager([]), DistInfo(world_size=2))


def test_resuming_without_partial_rollouts_says_what_it_drops(caplog):
    """A checkpoint holding a carry buffer, loaded by a run with partial rollouts off: the loader's
    state goes to the batch filler, and a warning names the groups and samples left untrained."""
    import logging

    from rlcore.trainer.partial import STATE_KEY, LoaderState

    class Fill:
        loaded = None

        def load_state_dict(self, state):
            Fill.loaded = state

    state = {"epoch": 1, "carry": [], STATE_KEY: {"groups": [{"samples": [{}, {}]}, {"samples": [{}, {}]}]}}
    with caplog.at_level(logging.WARNING):
        LoaderState(Fill()).load_state_dict(state)
    assert Fill.loaded == {"epoch": 1, "carry": []}
    assert "2 group(s) (4 samples)" in caplog.text and "ppo.partial_rollout.segment" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        LoaderState(Fill()).load_state_dict({"epoch": 2, STATE_KEY: {"groups": []}})
    assert Fill.loaded == {"epoch": 2} and not caplog.text


@pytest.mark.parametrize("slots, segment, warned", [(32, 0, True), (36, 0, False), (64, 0, False), (32, 6, False)])
def test_the_tail_cut_warns_where_the_carried_samples_find_no_slot(caplog, slots, segment, warned):
    """A step draws 8 prompts x 4 samples; with ``tail_rows=4`` up to 4 more are carried in, so fewer than
    36 generation slots leave some waiting for a slot: the warning names the batch size to set."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    ppo = OmegaConf.create({"partial_rollout": {"segment": segment, "tail_rows": 4}})
    trainer = SimpleNamespace(c=SimpleNamespace(prompts=SimpleNamespace(fill=SimpleNamespace(size=8))), ppo=ppo,
                              n=4, gen_cfg=SimpleNamespace(max_new_tokens=MAX_NEW, batch_size=slots))
    with caplog.at_level("WARNING", logger="rlcore.trainer.partial"):
        PartialSource(trainer)
    said = [r.getMessage() for r in caplog.records if "tail_rows" in r.getMessage()]
    assert bool(said) == warned
    if warned:
        assert "ppo.generation.batch_size=32" in said[0] and "at least 36" in said[0]
