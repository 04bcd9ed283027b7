"""The update's forward and backward of finished groups, overlapped with the rest of the rollout
(``ppo.overlap_update``).

A reasoning rollout ends in a long tail: a few long responses decode while the device is nearly
idle, and the update waits for them. Where the step's update is one optimizer step computed from
the rollout alone (:func:`ineligible` says when), each group of ``n`` samples can be trained on as
soon as all of its samples are finished and scored: its advantages need only its own scores.

:class:`OverlapUpdate` is the rollout's ``on_finished`` callback, chained after the
:class:`~rlcore.trainer.scoring.StreamingScorer`. A worker thread takes the groups in the order the
decode completes them (never in wall-clock order), waits for their scores, builds their
:class:`~rlcore.trainer.experience.Experience` rows with the trainer's own shaping and advantage
functions, cuts them into micro-batches by the update's rule (``ppo.micro_batch_size`` samples or
``ppo.max_tokens_per_micro_batch`` tokens, the longest first with ``ppo.group_by_length``; a
micro-batch runs once it is closed, the open one waits for more samples) and runs each one's
forward and backward (:func:`~rlcore.trainer.update.actor_micro_step`): gradients accumulate in
``.grad``, no optimizer step runs, so the weights the decode reads never change. Each loss is
weighed by its count over a provisional denominator (:func:`~rlcore.trainer.update.provisional_total`);
after the rollout :func:`~rlcore.trainer.update.ppo_update` rescales what was accumulated to the
true weights, trains on the samples left (the tail's groups, the open micro-batch) and steps.

On CUDA the worker runs on a stream of the lowest priority and the decode, while an overlapped
rollout runs, on one of the highest, so the decode's kernels are scheduled first. When the rollout
ends the worker still runs every micro-batch closed by then: which samples it trains on, and in
which order, depends only on the order in which the decode reported them.

Failures: an error in the worker is raised in the trainer's thread (at the next finished sample,
or at the end of the rollout); an out-of-memory error drops what the worker accumulated (its
gradients are cleared) and every sample trains after the rollout (``update/overlap_oom``); so does
a sample whose final tokens differ from the ones it was trained on (a rollout chunk retried after
an out-of-memory error, ``update/overlap_discarded``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from rlcore.rollout.base import RolloutBatch, left_pad
from rlcore.trainer.experience import Experience
from rlcore.trainer.generation import is_oom
from rlcore.trainer.packing import micro_batches
from rlcore.trainer.scoring import rows as _rows
from rlcore.trainer.update import Accumulated, host_stats, share_counts

log = logging.getLogger(__name__)

#: Advantage estimators whose advantages depend only on the group's scores (no critic, no
#: whitening over the batch, no extra rollout).
OVERLAP_ESTIMATORS = ("grpo", "rloo")
#: Seconds the trainer waits, after the rollout, for the worker to make progress before it gives up.
STALL_S = 900.0


def ineligible(trainer: Any, samples: int, scorer: Any, episodes: Sequence[Any]) -> Optional[str]:
    """Why the update of a rollout of ``samples`` cannot overlap it (None: it can). ``trainer`` is the
    :class:`~rlcore.trainer.loop.Trainer`; ``scorer``: the rollout's streaming scorer, if any."""
    from rlcore.trainer.update import on_policy

    cfg, c = trainer.cfg, trainer.c
    checks = (
        (trainer.dist.world_size > 1, f"{trainer.dist.world_size} processes (one is needed)"),
        (not on_policy(samples, cfg.ppo, int(cfg.trainer.gradient_accumulation_steps)),
         "the update is not one optimizer step over the rollout (ppo.ppo_epochs=1 and one mini-batch are needed)"),
        (c.ref is not None, "a reference model (its log-probs come after the rollout)"),
        (c.critic is not None, "a critic (its values come after the rollout)"),
        (str(cfg.algorithm.adv_estimator) not in OVERLAP_ESTIMATORS,
         f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (one of {', '.join(OVERLAP_ESTIMATORS)} is needed: "
         "advantages from the group's scores alone)"),
        (bool(cfg.algorithm.dynamic_sampling.enable), "algorithm.dynamic_sampling (groups are kept after the rollout)"),
        (str(cfg.ppo.rollout_is) != "none", "ppo.rollout_is (the rollout's log-probs come with its end)"),
        (bool(episodes), "multi-turn episodes (scored when they end)"),
        (scorer is None, "no streaming reward scoring (reward.stream=false, a reward model, or several processes)"),
        (any(p.grad is not None for p in c.actor.model.parameters()), "the actor holds gradients before the rollout"),
    )
    return next((why for bad, why in checks if bad), None)


@dataclass
class Plan:
    """How the worker cuts and weighs micro-batches (the update's own settings): ``micro`` samples or
    ``budget`` tokens each (``packed``: real tokens), the longest first (``by_length``); each loss
    weighs its :func:`~rlcore.trainer.update.share_counts` count (``loss_agg``) over ``denominator``."""

    micro: int
    budget: int
    packed: bool
    by_length: bool
    loss_agg: str
    denominator: float


#: ``prepare(rollout, raw_scores, group) -> Experience``: a group's rows, shaped scores and advantages
Prepare = Callable[[RolloutBatch, torch.Tensor, int], Experience]
#: ``train(exp, idx, weight, stats, k) -> log-probs``: one micro-batch's forward and backward
Train = Callable[[Experience, torch.Tensor, float, dict, int], torch.Tensor]


class OverlapUpdate:
    """The overlapped update of one rollout (see the module docstring).

    Use as the rollout's ``on_finished`` inside :meth:`decoding`; then :meth:`finish` with the
    finished rollout, and :meth:`close` in any case.

    :param scorer: the rollout's :class:`~rlcore.trainer.scoring.StreamingScorer` (called first).
    :param prompts: the rollout's prompts (token ids), ``n`` consecutive ones per group.
    :param width: response columns of the rows (``ppo.generation.max_new_tokens``).
    :param model: the trained actor (its gradients are cleared when the worker's work is dropped).
    :param device: where the actor trains.
    """

    def __init__(self, scorer: Callable, prompts: Sequence[Sequence[int]], n: int, *, prepare: Prepare, train: Train,
                 plan: Plan, width: int, pad_token_id: int, model: torch.nn.Module, device: torch.device):
        self.scorer, self.n, self.prepare, self.train, self.plan = scorer, int(n), prepare, train, plan
        self.model, self.device, self.width, self.pad = model, torch.device(device), int(width), int(pad_token_id)
        self.prompt_ids, self.prompt_mask = left_pad(prompts, self.pad)  # the rollout's prompt layout
        self.samples = len(prompts)
        self.acc = Accumulated()
        self.oom = 0
        self.discarded = False
        self._events: queue.Queue = queue.Queue()
        self._reported: dict[int, tuple[list[int], Any, int]] = {}  # sample -> (tokens, scoring future, its place)
        self._finished: dict[int, int] = {}  # group -> samples reported
        self._taken: set[int] = set()  # groups handed to the worker
        self._pending: Optional[Experience] = None  # rows waiting for a closed micro-batch
        self._pending_ids = torch.zeros(0, dtype=torch.long)
        self._error: Optional[BaseException] = None
        self._abort = threading.Event()
        self._stopped = False  # no more training this rollout (an out-of-memory error)
        self._progress = time.monotonic()
        self._stream = self._decode_stream = None
        if self.device.type == "cuda":
            self._stream, self._decode_stream = _streams(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the last optimizer step
        self._thread = threading.Thread(target=self._run, name="rlcore-overlap-update", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the trainer's thread
    def __call__(self, indices: list[int], responses: list[list[int]]) -> None:
        """The rollout's callback: score the finished samples, then hand them to the worker."""
        if self._error is not None:
            raise self._error  # the worker failed: stop the rollout now
        future = self.scorer(indices, responses)
        self._events.put((list(indices), [list(r) for r in responses], future))

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Run the rollout inside: on CUDA on a high-priority stream, ordered with the default one."""
        if self._decode_stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self._decode_stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._decode_stream):
                yield
        finally:
            current.wait_stream(self._decode_stream)

    def finish(self, rollout: RolloutBatch) -> tuple[Accumulated, dict[str, float]]:
        """After the rollout: wait for the worker to run the micro-batches closed so far, check that
        every sample it trained on kept its tokens, and return what it accumulated and its metrics.
        Raises what the worker raised."""
        t0 = time.perf_counter()
        self._progress = time.monotonic()
        self._events.put(None)
        self._join()
        if self._error is not None:
            self._drop()
            raise self._error
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        final = _rows(rollout.response_ids, rollout.response_mask)
        done = self.acc.done.tolist()
        if any(i >= len(final) or final[i] != self._reported[i][0] for i in done):
            log.warning("overlapped update: a sample's final tokens differ from the ones it was trained on during "
                        "the rollout (a chunk retried after an out-of-memory error); the whole update runs after "
                        "the rollout")
            self.discarded = True
            self._drop()
        self.acc.wait_s = time.perf_counter() - t0
        return self.acc, self.metrics()

    def metrics(self) -> dict[str, float]:
        return {"update/overlapped_frac": len(self.acc.done) / max(1, self.samples),
                "update/overlap_oom": float(self.oom), "update/overlap_discarded": float(self.discarded),
                "time/update_overlap_s": self.acc.seconds, "time/update_overlap_wait_s": self.acc.wait_s}

    def close(self) -> None:
        """Stop the worker (bounded); after a failed step, drop what it accumulated."""
        if self._thread.is_alive():
            self._abort.set()
            self._events.put(None)
            self._thread.join(timeout=min(STALL_S, 60.0))  # the worker stops between micro-batches
            if self._thread.is_alive():
                log.warning("overlapped update: the worker did not stop within 60 s; leaving it")
        if self._error is not None or self._abort.is_set():
            self._drop()

    def _join(self) -> None:
        """Wait for the worker; raise if it stops making progress for :data:`STALL_S` seconds."""
        while self._thread.is_alive():
            self._thread.join(timeout=1.0)
            if self._thread.is_alive() and time.monotonic() - self._progress > STALL_S:
                self._abort.set()
                from rlcore.errors import TrainingError

                raise TrainingError(f"overlapped update (ppo.overlap_update): the worker made no progress in "
                                    f"{STALL_S:.0f} s after the rollout ended; set ppo.overlap_update=false")

    def _drop(self) -> None:
        """Forget the worker's work: its gradients (there were none before the rollout) and micro-batches."""
        for p in self.model.parameters():
            p.grad = None
        self.acc = Accumulated(wait_s=self.acc.wait_s, seconds=self.acc.seconds)

    # ---------------------------------------------------------------- the worker's thread
    def _run(self) -> None:
        with _on(self.device, self._stream):
            while True:
                event = self._events.get()
                if event is None or self._abort.is_set():
                    return
                if self._error is not None or self._stopped:
                    continue  # keep draining the reports; nothing more trains
                try:
                    self._take(*event)
                except _Stopped:
                    return
                except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
                    if is_oom(error):
                        self._out_of_memory(error)
                    else:
                        self._error = error
                self._progress = time.monotonic()

    def _out_of_memory(self, error: BaseException) -> None:
        self.oom += 1
        self._stopped = True
        log.warning("overlapped update: out of memory in a micro-batch during the rollout (%s); its samples and "
                    "those already trained on run in the update after the rollout", str(error).splitlines()[0][:200])
        self._drop()

    def _take(self, indices: list[int], responses: list[list[int]], future: Any) -> None:
        """Record reported samples; every group they complete trains, in the order completed."""
        ready = []
        for k, (i, tokens) in enumerate(zip(indices, responses)):
            group = i // self.n
            if i not in self._reported:
                self._finished[group] = self._finished.get(group, 0) + 1
            self._reported[i] = (tokens, future, k)  # a retried chunk's report replaces the earlier one
            if self._finished[group] == self.n and group not in self._taken:
                self._taken.add(group)
                ready.append(group)
        for group in ready:
            self._add_group(group)
            self._train_closed()

    def _add_group(self, group: int) -> None:
        """The group's rows (its scores waited for) join the pending ones."""
        idx = list(range(group * self.n, (group + 1) * self.n))
        raw = []
        for i in idx:
            _, future, k = self._reported[i]
            raw.append(float(self._result(future)[1][k]))
        resp = torch.full((self.n, self.width), self.pad, dtype=torch.long)
        mask = torch.zeros(self.n, self.width, dtype=torch.long)
        for row, i in enumerate(idx):
            tokens = self._reported[i][0][:self.width]
            resp[row, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
        rollout = RolloutBatch(prompt_ids=self.prompt_ids[idx], prompt_mask=self.prompt_mask[idx], response_ids=resp,
                               response_mask=mask, logprobs=torch.zeros(self.n, self.width))
        exp = self.prepare(rollout, torch.tensor(raw, dtype=torch.float32), group)
        self._pending = exp if self._pending is None else _cat(self._pending, exp)
        self._pending_ids = torch.cat([self._pending_ids, torch.tensor(idx, dtype=torch.long)])

    def _result(self, future: Any) -> Any:
        """``future``'s result, waited for until it comes or the worker is stopped (:meth:`close`)."""
        while True:
            try:
                return future.result(timeout=0.2)
            except FutureTimeout:
                if self._abort.is_set():
                    raise _Stopped() from None

    def _train_closed(self) -> None:
        """Forward and backward of every closed micro-batch of the pending rows (all but the open one)."""
        pending, plan = self._pending, self.plan
        order = torch.arange(pending.size)
        if plan.by_length:
            order = order[torch.sort(pending.attention_mask.sum(-1).cpu(), descending=True, stable=True).indices]
        groups = micro_batches(pending.attention_mask, pending.response_mask, order, plan.micro, plan.budget,
                               plan.packed)
        closed = groups[:-1] if plan.budget > 0 else [g for g in groups if len(g) == plan.micro]
        for local in closed:
            if self._abort.is_set():
                return
            t0 = time.perf_counter()
            weight = share_counts(pending.response_mask, [local], plan.loss_agg)[0] / plan.denominator
            stats: dict[str, list[float]] = defaultdict(list)
            logp = self.train(pending, local.to(pending.input_ids.device), weight, stats, len(self.acc.groups))
            self.acc.groups.append(self._pending_ids[local])
            self.acc.provisional.append(weight)
            self.acc.logprobs.append(logp.detach().float())
            for name, values in host_stats(stats).items():  # read here, on the stream that computed them
                self.acc.stats[name].extend(values)
            self.acc.seconds += time.perf_counter() - t0
            self._progress = time.monotonic()
        if closed:
            keep = torch.ones(pending.size, dtype=torch.bool)
            keep[torch.cat(closed)] = False
            rest = keep.nonzero().flatten()
            self._pending, self._pending_ids = pending.select(rest.to(pending.input_ids.device)), self._pending_ids[rest]


class _Stopped(Exception):
    """The worker was stopped while it waited (:meth:`OverlapUpdate.close`)."""


@functools.lru_cache(maxsize=None)
def _streams(device: torch.device) -> tuple[Any, Any]:
    """The worker's and the decode's CUDA streams on ``device``, made once (not a new pool stream each step):
    the worker's at the lowest priority (0, the default stream's: PyTorch refuses a positive one), the
    decode's at the highest (a priority below the range is clamped to its top)."""
    return torch.cuda.Stream(device, priority=0), torch.cuda.Stream(device, priority=-(1 << 10))


@contextlib.contextmanager
def _on(device: torch.device, stream: Any) -> Iterator[None]:
    """This thread's work on ``device`` and ``stream`` (CUDA), or as it is (CPU)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def _cat(a: Experience, b: Experience) -> Experience:
    """The rows of ``a`` then ``b`` (same columns)."""
    joined = {}
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        joined[f.name] = torch.cat([x, y]) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x
    return Experience(**joined)


def start(trainer: Any, scorer: Any, prompts: Sequence[Sequence[int]],
          episodes: Sequence[Any]) -> Optional[OverlapUpdate]:
    """The overlapped update of the rollout of ``prompts`` where ``ppo.overlap_update`` asks for it
    and the step allows it (the reason it does not is logged once; ``Trainer.update`` then reports
    ``update/overlapped_frac`` 0)."""
    from rlcore.trainer.sampled import Sampled
    from rlcore.trainer.update import Batching, actor_micro_step, provisional_total, token_budget

    cfg, c = trainer.cfg, trainer.c
    if not cfg.ppo.overlap_update:
        return None
    why = ineligible(trainer, len(prompts), scorer, episodes)
    if why is not None:
        if why not in trainer.notes:
            trainer.notes.add(why)
            log.warning("ppo.overlap_update=true, but the update runs after the rollout: %s", why)
        return None
    ppo, n = cfg.ppo, trainer.n
    actor = c.actor.model
    cut = Batching.from_config(len(prompts), ppo, int(cfg.trainer.gradient_accumulation_steps), strict=False)
    plan = Plan(micro=cut.micro, budget=token_budget(ppo, c.recompute), packed=c.packed,
                by_length=bool(ppo.group_by_length), loss_agg=str(ppo.loss_agg),
                denominator=provisional_total(len(prompts), int(ppo.generation.max_new_tokens), str(ppo.loss_agg)))
    temperature = float(ppo.generation.temperature) or 1.0

    def prepare(rollout: RolloutBatch, raw: torch.Tensor, group: int) -> Experience:
        scores, _ = trainer.shape_scores(rollout, raw)
        batch = Sampled(rollout=rollout, scores=scores, raw_scores=raw, reward_metrics={},
                        truncated=trainer.truncated(rollout), group_ids=torch.full((len(raw),), group))
        exp = trainer.experience(batch, timed=False)[0]
        exp.rollout_logprobs = None  # the rollout's log-probs come with its end (the mismatch metrics then)
        return exp

    def train(exp: Experience, idx: torch.Tensor, weight: float, stats: dict, k: int) -> torch.Tensor:
        actor.train()  # as the update trains (building a group's rows switched the policy to eval)
        return actor_micro_step(actor, exp, idx, weight, stats, ppo=ppo, temperature=temperature, kl_loss_coef=0.0,
                                packed=c.packed, recompute=c.recompute, k=k)[1]

    return OverlapUpdate(scorer, prompts, n, prepare=prepare, train=train, plan=plan,
                         width=int(ppo.generation.max_new_tokens), pad_token_id=int(c.tokenizer.pad_token_id),
                         model=actor, device=c.train_device)
