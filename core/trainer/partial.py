"""Partial rollouts (``ppo.partial_rollout.segment``, ``ppo.partial_rollout.tail_rows``): a sample decodes at
most ``segment`` new tokens a step, and a step's generation ends once at most ``tail_rows`` samples are
still decoding (the long tail of a rollout of varied lengths); the unfinished ones are carried into the
next step and a prompt's group trains at the step in which its last sample finishes.

Each step :class:`PartialSource` draws ``ppo.rollout_batch_size`` new prompts as the default source
does, then generates, in one call, every unfinished sample of the carry buffer (its prompt followed by
its response so far, re-prefilled as the prompt under the current weights) and the new samples, each
with at most ``segment`` new tokens (``max_new_tokens`` without a segment) and the call's
``SamplingParams.stop_at_rows`` set to ``tail_rows``. A carried sample's new tokens stop at its remaining
budget (``ppo.generation.max_new_tokens`` minus its tokens so far: a per-prompt limit where the backend
takes one, a cut afterwards otherwise) and are joined to its earlier segments, tokens and rollout
log-probs alike. A sample is finished when its response holds an end-of-sequence token, reaches
``max_new_tokens``, or stopped short of its limit without one and without being cut by ``tail_rows``
(a backend that ended it on its own). The groups whose samples have all finished are scored and
trained, oldest first; the others wait in the buffer (finished samples of an incomplete group too, with
the group's reward inputs). The ``rlcore_before_generation``/``rlcore_after_generation`` hooks see the
step's one generation call (a carried sample's prompt holds its response so far); the trained batch holds
each group's own prompt.

The tokens of a carried sample come from the policies of several steps: their rollout log-probs are
those of the policy that sampled each segment, so ``ppo.rollout_is`` (required) weighs every token by
the trainer's policy against the one that generated it.

A checkpoint holds the buffer beside the data position (:class:`CarryState`), so a resumed run trains
exactly what the uninterrupted run trains.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlcore.errors import ConfigError
from rlcore.rollout.base import RolloutBatch, left_pad
from rlcore.trainer.sampled import Sampled

log = logging.getLogger(__name__)

#: The key of the carry buffer in the checkpoint's data state (beside the loader's position).
STATE_KEY = "partial_rollout"


def enabled(ppo: Any) -> bool:
    """Whether the ``ppo`` section turns partial rollouts on (a segment or tail rows)."""
    partial = ppo.partial_rollout
    return int(partial.segment) > 0 or int(partial.tail_rows) > 0


def check_world(cfg: Any, world_size: int, split: Any = None) -> None:
    """Refuse partial rollouts in a job of several processes or one a plugin splits into training and
    rollout ranks (known when the trainer is built, before any model loads).

    :raises ConfigError: naming ``ppo.partial_rollout.segment`` and the conflicting setting.
    """
    from rlcore.config.loader import partial_rollout_key, partial_rollout_problems

    if not enabled(cfg.ppo):
        return
    problems = partial_rollout_problems(cfg, world_size)
    if split is not None:
        partial = cfg.ppo.partial_rollout
        name = partial_rollout_key(partial)
        problems.append(f"'ppo.partial_rollout.{name}' = {partial[name]} (partial rollouts) runs in one process "
                        f"only, but a plugin splits this job into training and rollout ranks (rlcore_world_split, "
                        f"{type(split[0]).__name__}): drop that plugin or set ppo.partial_rollout.{name}=0")
    if problems:
        raise ConfigError(problems)


@dataclass
class Carried:
    """One sample of a group in the buffer: its response so far and where its tokens came from."""

    #: the response tokens so far (every segment joined)
    tokens: list[int] = field(default_factory=list)
    #: the rollout log-probs of :attr:`tokens` (each segment's from the policy that sampled it); None: no segment yet
    logprobs: Optional[torch.Tensor] = None
    #: ``[step, tokens]`` of each segment, in order
    segments: list[list[int]] = field(default_factory=list)
    #: no more tokens will be decoded for it
    done: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "logprobs": None if self.logprobs is None else self.logprobs.clone(),
                "segments": [list(s) for s in self.segments], "done": bool(self.done)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Carried":
        lp = state.get("logprobs")
        return cls(tokens=[int(t) for t in state["tokens"]], logprobs=None if lp is None else lp.clone(),
                   segments=[[int(a), int(b)] for a, b in state["segments"]], done=bool(state["done"]))


@dataclass
class Group:
    """The ``ppo.generation.n`` samples of one prompt, with the prompt's reward inputs (its other columns)."""

    prompt: list[int]
    #: column -> the ``n`` values of the group's samples (what :meth:`Trainer.expand` gives the reward)
    extras: dict[str, list]
    samples: list[Carried]
    #: the step that drew the prompt
    drawn: int

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def state_dict(self) -> dict[str, Any]:
        return {"prompt": list(self.prompt), "extras": copy.deepcopy(self.extras), "drawn": int(self.drawn),
                "samples": [s.state_dict() for s in self.samples]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Group":
        return cls(prompt=[int(t) for t in state["prompt"]], extras=copy.deepcopy(dict(state["extras"])),
                   samples=[Carried.from_state(s) for s in state["samples"]], drawn=int(state["drawn"]))


class CarryState:
    """The data state a checkpoint holds with partial rollouts: the loader's position (the batch filler's
    state, as without them) plus the carry buffer under :data:`STATE_KEY`. A state saved without partial
    rollouts loads as an empty buffer."""

    def __init__(self, source: "PartialSource"):
        self.source = source

    def state_dict(self) -> dict[str, Any]:
        return {**copy.deepcopy(self.source.filler.state_dict()),
                STATE_KEY: {"groups": [g.state_dict() for g in self.source.groups]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rest = dict(state)
        carried = rest.pop(STATE_KEY, None)
        self.source.filler.load_state_dict(rest)
        self.source.load_groups([] if carried is None else list(carried.get("groups", [])))


def _check_tail_slots(tail_rows: int, new: int, slots: int) -> None:
    """Warn where a step's new samples and the up to ``tail_rows`` carried ones do not all fit the
    generation's ``slots`` (``ppo.generation.batch_size``): the samples past the slots start only when others
    end, so the carried, longest ones finish late and the step's generation lasts longer than the tail it cut
    (measured on an H100: docs/benchmarks.md, "Reasoning workload")."""
    if slots < new + tail_rows:
        log.warning("ppo.partial_rollout.tail_rows=%d carries up to %d samples into each step beside its %d new ones, "
                    "but ppo.generation.batch_size=%d decodes at most %d at once: the samples past it wait for a "
                    "slot; set ppo.generation.batch_size to at least %d", tail_rows, tail_rows, new, slots, slots,
                    new + tail_rows)


class PartialSource:
    """The :class:`~rlcore.protocols.RolloutSource` of partial rollouts (see the module docstring).

    :param trainer: the :class:`~rlcore.trainer.loop.Trainer` whose prompts, generation, reward and
        hooks it uses (``ppo.partial_rollout.segment > 0`` or ``ppo.partial_rollout.tail_rows > 0``).
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.filler = trainer.c.prompts.fill
        partial = trainer.ppo.partial_rollout
        self.segment = int(partial.segment)
        self.tail_rows = int(partial.tail_rows)
        if self.segment < 0 or self.tail_rows < 0 or not (self.segment or self.tail_rows):
            raise ValueError(f"PartialSource: ppo.partial_rollout needs segment > 0 or tail_rows > 0, got segment "
                             f"{self.segment}, tail_rows {self.tail_rows}")
        self.max_new = int(trainer.gen_cfg.max_new_tokens)
        self.n = int(trainer.n)
        if self.tail_rows and not self.segment:
            _check_tail_slots(self.tail_rows, int(self.filler.size) * self.n, int(trainer.gen_cfg.batch_size))
        #: the carry buffer: groups drawn and not yet trained, oldest first
        self.groups: list[Group] = []
        self._metrics: dict[str, float] = {}
        self._cut = 0  # samples the last generation call ended unfinished (tail_rows)

    # -- RolloutSource ---------------------------------------------------------------------------
    def next(self, step: int) -> Sampled:
        """Draw this step's prompts, decode one segment of every open sample, and return the groups
        that finished (possibly none), scored, with group ids ``0..G-1``."""
        t, c = self.trainer, self.trainer.c
        rows = c.prompts.fill(c.prompts.loader.next_batch())
        prompts, extras = t.expand(rows)
        for g in range(len(rows)):
            part = slice(g * self.n, (g + 1) * self.n)
            self.groups.append(Group(prompt=list(prompts[g * self.n]), extras={k: list(v[part]) for k, v in extras.items()},
                                     samples=[Carried() for _ in range(self.n)], drawn=step))
        rollout = self._decode(step)
        done = [g for g in self.groups if g.complete]
        self.groups = [g for g in self.groups if not g.complete]
        self._metrics = self._step_metrics(done, step)
        if not done:
            return _empty(rollout)
        batch, batch_extras = self._assemble(done, rollout)
        with t.timer("reward"):
            raw, m_reward = t.score(batch, batch_extras)
        scores, shaping = t.shape_scores(batch, raw)
        m_reward.update(shaping)
        return Sampled(rollout=batch, scores=scores, raw_scores=raw, reward_metrics=m_reward,
                       truncated=t.truncated(batch), group_ids=torch.arange(len(done)).repeat_interleave(self.n))

    def data_state(self) -> CarryState:
        return CarryState(self)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self, failed: bool = False) -> None:
        pass

    # -- the buffer --------------------------------------------------------------------------------
    def load_groups(self, states: list[dict[str, Any]]) -> None:
        """Restore the carry buffer from a checkpoint (an empty list: none carried). A sample as long as
        ``ppo.generation.max_new_tokens`` (lowered since the save) is finished."""
        groups = [Group.from_state(s) for s in states]
        sizes = sorted({len(g.samples) for g in groups} - {self.n})
        if sizes:
            raise ValueError(f"the checkpoint carries groups of {sizes[0]} samples, but ppo.generation.n is {self.n}: "
                             "resume with the saved ppo.generation.n (or set trainer.resume=disable)")
        for g in groups:
            for s in g.samples:
                s.done = s.done or len(s.tokens) >= self.max_new
        self.groups = groups

    def _decode(self, step: int) -> RolloutBatch:
        """One segment of every open sample, carried ones first (oldest group first), in one call."""
        t, c = self.trainer, self.trainer.c
        open_ = [(g, s) for g in self.groups for s in g.samples if not s.done]
        prompts = [g.prompt + s.tokens for g, s in open_]
        params = t.sampling(step)  # a lower cap of the step's own (a warm-up's) holds too
        cap = min(self.segment or self.max_new, self.max_new, params.max_new_tokens)
        params = dataclasses.replace(params, max_new_tokens=cap, stop_at_rows=self.tail_rows)
        # each sample's limit this step: the cap, or less where its response budget is nearly spent
        limits = [max(1, min(cap, self.max_new - len(s.tokens))) for _, s in open_]
        t.hook.rlcore_before_generation(step=step, prompts=prompts)
        with t.timer("generate"):
            # one call: carried and new samples share the engine's slots (continuous batching)
            rollout = c.generation.generate(prompts, params, whole=True, max_new_tokens=limits)
        t.hook.rlcore_after_generation(step=step, rollout=rollout)
        eos = set(int(e) for e in c.eos_ids)
        ids, mask, logprobs = rollout.response_ids.cpu(), rollout.response_mask.cpu().bool(), rollout.logprobs.cpu()
        cut = rollout.cut.cpu().tolist() if rollout.cut is not None else [False] * len(open_)
        for row, (_, sample) in enumerate(open_):
            got = ids[row][mask[row]]
            keep = min(len(got), self.max_new - len(sample.tokens))
            new = got[:keep].tolist()
            lp = logprobs[row][mask[row]][:keep].detach().clone()
            sample.tokens += new
            sample.logprobs = lp if sample.logprobs is None else torch.cat([sample.logprobs, lp])
            sample.segments.append([step, keep])
            sample.done = (any(tok in eos for tok in new) or len(sample.tokens) >= self.max_new
                           or (len(got) < limits[row] and not cut[row]))
        self._cut = sum(map(bool, cut))
        return rollout

    def _assemble(self, groups: list[Group], generated: RolloutBatch) -> tuple[RolloutBatch, dict[str, list]]:
        """The trained rows of ``groups`` (prompts left-padded, responses right-padded with the pad token,
        on the generated batch's device, with its stats) and their reward inputs."""
        pad = int(self.trainer.c.tokenizer.pad_token_id)
        samples = [(g, s) for g in groups for s in g.samples]
        prompt_ids, prompt_mask = left_pad([g.prompt for g, _ in samples], pad)
        width = max(1, max(len(s.tokens) for _, s in samples))
        dtype = next((s.logprobs.dtype for _, s in samples if s.logprobs is not None), generated.logprobs.dtype)
        response_ids = torch.full((len(samples), width), pad, dtype=torch.long)
        response_mask = torch.zeros((len(samples), width), dtype=torch.long)
        logprobs = torch.zeros((len(samples), width), dtype=dtype)
        for i, (_, s) in enumerate(samples):
            k = len(s.tokens)
            if k:
                response_ids[i, :k] = torch.tensor(s.tokens, dtype=torch.long)
                response_mask[i, :k] = 1
                logprobs[i, :k] = s.logprobs
        device = generated.response_ids.device
        batch = RolloutBatch(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                             response_ids=response_ids.to(device), response_mask=response_mask.to(device),
                             logprobs=logprobs.to(device), stats=dict(generated.stats))
        columns = sorted({k for g in groups for k in g.extras})
        extras = {k: [v for g in groups for v in g.extras.get(k, [None] * len(g.samples))] for k in columns}
        return batch, extras

    def _step_metrics(self, done: list[Group], step: int) -> dict[str, float]:
        trained = [s for g in done for s in g.samples]
        tokens = sum(len(s.tokens) for s in trained)
        stale = sum(n for s in trained for at, n in s.segments if at < step)
        return {"partial/groups_trained": float(len(done)), "partial/samples_cut": float(self._cut),
                "partial/samples_carried": float(sum(not s.done for g in self.groups for s in g.samples)),
                "partial/groups_waiting": float(len(self.groups)),
                "partial/stale_token_frac": stale / tokens if tokens else 0.0,
                "partial/segments_max": float(max((len(s.segments) for s in trained), default=0))}


def _empty(generated: RolloutBatch) -> Sampled:
    """No group finished this step: an empty batch (the trainer skips the update)."""
    zeros = torch.zeros((0, 1), dtype=torch.long)
    rollout = RolloutBatch(prompt_ids=zeros, prompt_mask=zeros.clone(), response_ids=zeros.clone(),
                           response_mask=zeros.clone(), logprobs=torch.zeros((0, 1)), stats=dict(generated.stats))
    return Sampled(rollout=rollout, scores=torch.zeros(0), raw_scores=torch.zeros(0), reward_metrics={},
                   truncated=torch.zeros(0, dtype=torch.bool), group_ids=torch.zeros(0, dtype=torch.long))


class LoaderState:
    """The default source's data state: the batch filler's (the loader's position and the rows carried
    into the next batch). A checkpoint written with partial rollouts also holds their carry buffer:
    resumed without them, its samples are dropped, with a warning that says how many."""

    def __init__(self, fill: Any):
        self.fill = fill

    def state_dict(self) -> dict[str, Any]:
        return self.fill.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        groups = (state.pop(STATE_KEY, None) or {}).get("groups", [])
        if groups:
            samples = sum(len(g.get("samples", [])) for g in groups)
            log.warning("the checkpoint carries %d group(s) (%d samples) of partial rollouts not yet trained; "
                        "ppo.partial_rollout.segment is 0 in this run, so they are dropped (resume with the saved "
                        "segment to train them)", len(groups), samples)
        self.fill.load_state_dict(state)
