"""Continuous batching for :class:`~rlcore.rollout.engine.RolloutEngine`: one ``generate`` call.

Prompts wait in a queue; free cache slots are filled by prefilling groups of prompts; every
decode step advances all live slots by one token; a slot whose sequence reached
``max_new_tokens`` or emitted EOS is freed and its tokens are copied to the result. Once the
queue is empty the live slots are compacted to the front so that a smaller batch bucket runs.

The host keeps its own copy of what it needs per step (which slots are live, how many tokens
each has, the widest cache column), so a decode step reads nothing back from the device; only
the EOS flags are read, every ``eos_check_interval`` steps.

With the paged cache (:mod:`rlcore.rollout.engine.pages`) admission also waits for free pages
(the prompts' pages, with the live slots' next page kept in reserve), a slot gets its next page a
few steps before its sequence reaches it, and when the pool has none left, the slots whose EOS is
already out are finished first and then the youngest live slot is *preempted*: its pages go back,
its request returns to the front of the queue and is sampled afresh when it is admitted again
(``rollout/preemptions`` counts them).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from rlcore.kernels import step_kernels
from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad, mask_after_eos
from rlcore.rollout.engine.settings import FEW_ROWS
from rlcore.rollout.sampling import Sampler

if TYPE_CHECKING:
    from rlcore.rollout.engine import RolloutEngine

#: a slot gets its next page when its sequence is this many columns from the end of its pages
PAGE_LOOKAHEAD = 4
#: ... together with every slot within this many more columns of its end, so that one table update
#: serves the slots reaching a page boundary in the next steps (a page update every ~16 steps at most)
PAGE_BATCH = 16
#: prompts admitted together are prefilled in groups of similar length: a group's longest prompt is at
#: most this many times its shortest, or at most :data:`WIDTH_SLACK` tokens longer (each group is padded
#: to its own longest prompt, and every later decode step of a slot reads its cache from column 0: a
#: short prompt padded to a long one would pay for those columns in every step)
WIDTH_RATIO = 2
WIDTH_SLACK = 256
#: decode steps of a batch bucket of at most this many rows count as the call's tail
#: (``rollout/tail_steps``, ``rollout/tail_s``: the long tail of a rollout with varied lengths)
TAIL_ROWS = FEW_ROWS


def width_groups(lengths: Sequence[int], ratio: int = WIDTH_RATIO, slack: int = WIDTH_SLACK) -> list[list[int]]:
    """Indices of ``lengths`` in groups of similar length (longest first): a group takes the next longest
    while the group's first (longest) is at most ``ratio`` times it or at most ``slack`` longer."""
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            top = int(lengths[groups[-1][0]])
            if top <= ratio * int(lengths[i]) or top - int(lengths[i]) <= slack:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


class Scheduler:
    """Slots, queue and outputs of one ``generate`` call.

    Per slot ``s`` the host tracks the request it serves, ``born[s]`` (the decode-step count when it
    was prefilled: it then holds one token, and one more after each later step) and
    ``col0[s]`` (its next cache column is ``col0[s] + steps``).

    With ``params.stop_at_rows = K > 0`` the call ends at the first EOS check that finds at most ``K``
    slots decoding and no request waiting: those requests keep the tokens they have (their limit is
    lowered to them) and are marked in the result's ``cut``.
    """

    #: whether ``params.stop_at_rows`` may end the call early (episodes play to their end)
    CUTS = True

    def __init__(self, engine: "RolloutEngine", prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finished: Optional[Callable[[list[int], list[list[int]]], None]] = None,
                 limits: Optional[Sequence[int]] = None):
        self.eng, self.params = engine, params
        #: each request's token limit (at most ``max_new_tokens``)
        self.limit = [int(params.max_new_tokens)] * len(prompts) if limits is None else [int(v) for v in limits]
        self.on_finished = on_finished
        self.prompts = [list(p) for p in prompts]
        dev, cap, width = engine.device, engine.max_batch_size, params.max_new_tokens
        self.sample = Sampler(params, dev, fused=engine.fused_sampling)
        self.queue = deque(range(len(prompts)))
        self.slot_req: list[int | None] = [None] * cap
        self.born = [0] * cap
        self.col0 = [0] * cap
        self.live: list[int] = []
        self.max_col0 = 0
        self.due = 0
        self.out_tokens = torch.full((cap, width), params.pad_token_id, dtype=torch.long, device=dev)
        self.out_logprobs = torch.zeros(cap, width, dtype=torch.float32, device=dev)
        self.out_col = torch.zeros(cap, dtype=torch.long, device=dev)
        self.done = torch.zeros(cap, dtype=torch.bool, device=dev)
        self.eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=dev)
        self.res_tokens = torch.full((len(prompts), width), params.pad_token_id, dtype=torch.long, device=dev)
        self.res_logprobs = torch.zeros(len(prompts), width, dtype=torch.float32, device=dev)
        self.one_kernel = step_kernels.available(dev)
        self.steps = 0
        self.prefills = 0
        self.preempted = 0
        self.cut: list[int] = []  # requests the call ended unfinished (stop_at_rows)
        self.reserve = 1  # pages kept free per live slot at admission; doubles with each preemption
        self.grow_due = 0
        if engine.paged:
            engine.pool.peak = engine.pool.used
        self.bucket_steps: dict[int, int] = {}
        # decode steps of buckets of at most TAIL_ROWS rows; wall seconds between two such steps, and how many
        self.tail_steps, self.tail_s, self.tail_gaps = 0, 0.0, 0
        self.syncs = 0  # reads of device values on the host (each waits for the device)
        self.decode_rows = 0  # sums over decode steps: rows decoding, and the batch bucket run
        self.decode_batch = 0
        self.counters_at_start = dict(engine.counters)
        # host seconds of the loop's parts (a part that reads the device includes the wait for it)
        self.host_s = dict.fromkeys(("between", "admit", "launch", "finish"), 0.0)

    # -- host bookkeeping
    def _read(self, tensor: torch.Tensor) -> list:
        """``tensor.tolist()``, counted (a host read waits for the device)."""
        self.syncs += 1
        return tensor.tolist()

    def _rows(self, values: Sequence[int]) -> torch.Tensor:
        """Host indices as an int64 tensor on the device, without waiting for it."""
        return self.eng._to_device(torch.tensor(list(values), dtype=torch.long))

    def _count(self, slot: int) -> int:
        return 1 + self.steps - self.born[slot]

    def _relive(self) -> None:
        """Recompute the live list and what the step loop derives from it."""
        self.live = [s for s, r in enumerate(self.slot_req) if r is not None]
        self.max_col0 = max((self.col0[s] for s in self.live), default=0)
        self.due = min((self.born[s] + self.limit[self.slot_req[s]] - 1 for s in self.live), default=0)
        if self.eng.paged:  # the first step at which some live slot wants its next page
            size, cap, pages = self.eng.page_size, self.eng.max_seq_len, self.eng.slot_pages
            self.grow_due = min((len(pages[s]) * size - self.col0[s] - PAGE_LOOKAHEAD for s in self.live
                                 if len(pages[s]) * size < cap), default=self.steps + (1 << 30))

    # -- device bookkeeping
    def _record(self, n: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """The step's tokens of slots ``0..n-1`` become their next inputs and are written, with their
        log-probs, at the slots' output columns (one kernel where Triton runs)."""
        record = step_kernels.record if self.one_kernel else step_kernels.record_reference
        record(tokens, logprobs, self.eng.state.tokens, self.out_tokens, self.out_logprobs, self.out_col, self.done,
               self.eos)

    def _finish(self, slots: list[int], report: bool = True) -> None:
        if not slots:
            return
        rows = self._rows(slots)
        reqs = self._rows([self.slot_req[s] for s in slots])
        self.res_tokens.index_copy_(0, reqs, self.out_tokens.index_select(0, rows))
        self.res_logprobs.index_copy_(0, reqs, self.out_logprobs.index_select(0, rows))
        if report:
            self._report(rows, [self.slot_req[s] for s in slots])
        self.eng._release(slots)
        for s in slots:
            self.slot_req[s] = None
        self._relive()

    def _page_fit(self, limit: int) -> int:
        """How many of the first ``limit`` waiting requests fit in the free pages (an upper bound of
        their pages: each distinct prompt one more page than its length fills, each repeat one page,
        or all of them without page sharing), keeping ``reserve`` pages per live slot free for their
        growth: one, doubled at each preemption (a pool too small for what was admitted admits less)."""
        eng = self.eng
        size, room = eng.page_size, eng.pool.free - self.reserve * len(self.live)
        seen: set[tuple[int, ...]] = set()
        cost = fit = 0
        for req in itertools.islice(self.queue, limit):
            prompt = tuple(self.prompts[req])
            whole = -(-len(prompt) // size) + 1
            cost += 1 if prompt in seen and eng.share_pages else whole
            if cost > room:
                break
            seen.add(prompt)
            fit += 1
        return fit

    def _report(self, rows: torch.Tensor, reqs: list[int]) -> None:
        """Hand finished requests to ``on_finished``: their indices and response tokens up to and
        including the first EOS (what :meth:`result` keeps of them)."""
        if self.on_finished is None:
            return
        eos = set(self.params.eos_token_ids)
        responses = []
        for req, row in zip(reqs, self._read(self.out_tokens.index_select(0, rows))):
            row = row[:self.limit[req]]
            end = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            responses.append(row[:end])
        self.on_finished(list(reqs), responses)

    def _admit(self) -> None:
        free = [s for s, r in enumerate(self.slot_req) if r is None]
        take = min(len(free), len(self.queue))
        if self.eng.paged:
            take = self._page_fit(take)
        slots = free[:take]
        reqs = [self.queue.popleft() for _ in range(take)]
        logits, widths = self._prefill_groups(slots, [self.prompts[r] for r in reqs])
        tokens, logprobs = self._sample_admitted(logits, reqs)
        rows = self._rows(slots)
        self.eng.state.tokens[rows] = tokens
        self.done[rows] = torch.isin(tokens, self.eos) if self.eos.numel() else False
        width_out = self.params.max_new_tokens
        self.out_tokens.view(-1).index_copy_(0, rows * width_out, tokens)
        self.out_logprobs.view(-1).index_copy_(0, rows * width_out, logprobs)
        self.out_col[rows] = 1
        for s, r, width in zip(slots, reqs, widths):
            self.slot_req[s] = r
            self.born[s] = self.steps
            self.col0[s] = width - self.steps
        self._relive()
        self.prefills += 1

    def _prefill_groups(self, slots: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Prefill ``prompts`` into ``slots`` in groups of similar length (:func:`width_groups`), each
        padded to its own longest prompt; the next-token logits in the order of ``slots`` (sampled in
        one draw, as one group would be) and each slot's padded width (its first decode column)."""
        groups = width_groups([len(p) for p in prompts], WIDTH_RATIO, WIDTH_SLACK)
        if len(groups) == 1:
            logits, width = self.eng._prefill(slots, prompts, self.params.pad_token_id)
            return logits, [width] * len(slots)
        logits, widths = None, [0] * len(slots)
        for group in sorted(groups, key=min):  # the slots' order within a group is kept
            group = sorted(group)
            part, width = self.eng._prefill([slots[i] for i in group], [prompts[i] for i in group],
                                            self.params.pad_token_id)
            if logits is None:
                logits = part.new_empty(len(slots), *part.shape[1:])
            logits[self._rows(group)] = part
            for i in group:
                widths[i] = width
        return logits, widths

    def _should_admit(self) -> bool:
        if not self.queue:
            return False
        free = len(self.slot_req) - len(self.live)
        if free == 0:
            return False
        if self.live and free < max(1, int(self.eng.admit_fraction * len(self.slot_req))):
            return False
        return not self.eng.paged or self._page_fit(1) == 1

    def _grow(self) -> None:
        """Give every live slot whose sequence is about to run past its pages one more page; when the
        pool is short, finish the slots whose EOS is already out, then preempt the youngest."""
        eng = self.eng
        size, cap, pages = eng.page_size, eng.max_seq_len, eng.slot_pages
        horizon = self.steps + PAGE_LOOKAHEAD + PAGE_BATCH
        checked = False
        while True:
            need = [s for s in self.live if len(pages[s]) * size <= self.col0[s] + horizon
                    and len(pages[s]) * size < cap]
            if len(need) <= eng.pool.free:
                break
            if not checked and self.eos.numel():
                checked = True
                flags = self._read(self.done[:len(self.slot_req)])
                self._finish([s for s in self.live if flags[s]])
                continue
            if len(self.live) <= 1:
                raise RuntimeError(f"rollout engine: the KV page pool ({eng.pool.pages} pages) cannot hold one "
                                   f"sequence")
            self._preempt(max(self.live, key=lambda s: (self.born[s], s)))
        if need:
            eng._add_pages(need)
        self._relive()

    def _preempt(self, slot: int) -> None:
        """Free ``slot`` and put its request back at the front of the queue (sampled afresh later)."""
        self.queue.appendleft(self.slot_req[slot])
        self.eng._release([slot])
        self.slot_req[slot] = None
        self.preempted += 1
        self.reserve = min(2 * self.reserve, -(-self.eng.max_seq_len // self.eng.page_size))
        self._relive()

    def _maybe_compact(self) -> None:
        live = self.live
        if self.queue or not live:
            return
        if self.eng._bucket(len(live)) >= self.eng._bucket(live[-1] + 1):
            return
        self.eng._compact(live)
        perm = self._rows(live)
        m, cap = len(live), len(self.slot_req)
        for buf in (self.out_tokens, self.out_logprobs, self.out_col, self.done):
            buf[:m] = buf.index_select(0, perm)
        self.slot_req = [self.slot_req[s] for s in live] + [None] * (cap - m)
        self.born = [self.born[s] for s in live] + [0] * (cap - m)
        self.col0 = [self.col0[s] for s in live] + [0] * (cap - m)
        self._moved(live, perm)
        self._relive()

    def _moved(self, live: list[int], perm: torch.Tensor) -> None:
        """Compaction moved rows ``live`` to ``0..len(live)-1`` (``perm`` on the device): a subclass moves
        the per-row state of its own here, before the step loop's numbers are derived again."""

    def _finished(self, n: int) -> list[int]:
        """Slots done after this step: at the token limit, or (on check steps) past an EOS."""
        finished = self._at_limit() if self.steps >= self.due else []
        if self.eos.numel() and self.steps % self.eng.eos_check_interval == 0:
            flags = self._read(self.done[:n])
            finished = sorted(set(finished) | {s for s in self.live if flags[s]})
        return finished

    def _cut_due(self) -> bool:
        """Whether the call ends now with its last samples unfinished (``params.stop_at_rows``): on an EOS
        check step (the live slots' flags were just read), with at most that many decoding and none waiting."""
        most = int(self.params.stop_at_rows)
        return (self.CUTS and most > 0 and self.steps % self.eng.eos_check_interval == 0 and not self.queue
                and 0 < len(self.live) <= most)

    def _cut(self) -> None:
        """End the live samples where they are: each keeps its tokens so far (its limit lowered to them), is
        not reported as finished, and is marked in the result's ``cut``."""
        slots = list(self.live)
        for s in slots:
            req = self.slot_req[s]
            self.limit[req] = self._count(s)
            self.cut.append(req)
        self._finish(slots, report=False)

    def _at_limit(self) -> list[int]:
        """The live slots whose response reached its token limit."""
        return [s for s in self.live if self._count(s) >= self.limit[self.slot_req[s]]]

    def _sample_admitted(self, logits: torch.Tensor, reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first tokens of requests ``reqs`` from their prefill ``logits``."""
        return self.sample(logits)

    def _sample_step(self, logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of a decode step of slots ``0..n-1``."""
        return self.sample(logits)

    def _decoding(self) -> int:
        """Live slots whose tokens of this step are kept (a subclass's paused slots ride along)."""
        return len(self.live)

    def _pending(self) -> bool:
        """Whether the call has work left (a subclass adds sequences waiting outside the batch)."""
        return bool(self.queue or self.live)

    def _launched(self) -> None:
        """Called after each decode step is launched (a subclass may bound how far the host runs ahead)."""

    def _between_steps(self) -> None:
        """Called before each admission or decode step; a subclass continues paused sequences here
        (multi-turn rollouts: :mod:`rlcore.rollout.engine.turns`)."""

    def loop(self) -> None:
        clock, host = time.perf_counter, self.host_s
        last = None  # when the previous decode step was launched, if it was a tail step
        while self._pending():
            t0 = clock()
            self._between_steps()
            t1 = clock()
            host["between"] += t1 - t0
            if self._should_admit():
                self._admit()
                self._finish(self._at_limit())
                host["admit"] += clock() - t1
                continue
            if not self.live:  # every sequence waits outside the batch (between steps waits for them)
                continue
            self._maybe_compact()
            if self.eng.paged and self.steps >= self.grow_due:
                self._grow()
                if not self.live:  # the slots it finished were the last ones
                    continue
            n = self.eng._bucket(self.live[-1] + 1)
            length = self.eng._length_bucket(self.max_col0 + self.steps + 1)
            logits = self.eng._decode(n, length)
            tokens, logprobs = self._sample_step(logits, n)
            self._record(n, tokens, logprobs)
            self._launched()
            self.steps += 1
            self.bucket_steps[n] = self.bucket_steps.get(n, 0) + 1
            self.decode_rows += self._decoding()
            self.decode_batch += n
            t2 = clock()
            host["launch"] += t2 - t1
            # the tail's wall time, launch to launch: the host runs a bounded number of steps ahead of
            # the device (it reads the EOS flags every eos_check_interval steps), so over many steps
            # this follows the device's time
            if n <= TAIL_ROWS:
                self.tail_steps += 1
                if last is not None:
                    self.tail_s, self.tail_gaps = self.tail_s + t2 - last, self.tail_gaps + 1
            last = t2 if n <= TAIL_ROWS else None
            self._finish(self._finished(n))
            if self._cut_due():
                self._cut()
            host["finish"] += clock() - t2

    def loop_stats(self) -> dict[str, float]:
        """What the decode loop did: steps, prefills and extends, how full the decode batch was
        (rows decoding per step, the batch bucket run, their ratio), host reads, decode steps
        replayed from a CUDA graph or run eagerly, the graphs captured during the call (decode and extend;
        ``graph_capture_s`` counts both), extends replayed from a graph, and the host
        seconds of the loop's parts (``rollout/host_{between,admit,launch,finish}_s``: resuming paused
        sequences and waiting for them, admitting requests, launching decode steps, finding and
        finishing the done ones; a part that reads the device includes its wait), and the tail: decode
        steps of at most :data:`TAIL_ROWS` rows and their wall seconds (``rollout/tail_steps``,
        ``rollout/tail_s``; ``rollout/tail_step_ms`` the mean step)."""
        steps = max(self.steps, 1)
        done = {key: float(value - self.counters_at_start[key]) for key, value in self.eng.counters.items()}
        return {"rollout/decode_steps": float(self.steps), "rollout/prefill_calls": float(self.prefills),
                "rollout/prefill_tokens": done["prefill_tokens"], "rollout/extend_calls": done["extend_calls"],
                "rollout/extend_tokens": done["extend_tokens"], "rollout/graph_steps": done["graph_steps"],
                "rollout/eager_steps": done["eager_steps"], "rollout/host_syncs": float(self.syncs),
                "rollout/graph_captures": done["graph_captures"], "rollout/graph_capture_s": done["graph_capture_s"],
                "rollout/extend_graph_calls": done["extend_graph_calls"],
                "rollout/extend_graph_captures": done["extend_graph_captures"],
                "rollout/decode_rows_mean": self.decode_rows / steps,
                "rollout/decode_batch_mean": self.decode_batch / steps,
                "rollout/batch_occupancy": self.decode_rows / max(self.decode_batch, 1),
                "rollout/tail_steps": float(self.tail_steps), "rollout/tail_s": self.tail_s,
                "rollout/tail_step_ms": 1e3 * self.tail_s / max(self.tail_gaps, 1),
                **{f"rollout/host_{part}_s": seconds for part, seconds in self.host_s.items()}}

    def result(self) -> RolloutBatch:
        eng = self.eng
        prompt_ids, prompt_mask = left_pad(self.prompts, self.params.pad_token_id, eng.device)
        mask = mask_after_eos(self.res_tokens, self.params.eos_token_ids)
        limited = min(self.limit) < self.params.max_new_tokens
        if limited:  # per-request limits: nothing past a request's own
            limits = torch.tensor(self.limit, dtype=torch.long, device=eng.device)
            mask = mask * (torch.arange(mask.shape[1], device=eng.device)[None] < limits[:, None]).to(mask.dtype)
        width = int(mask.sum(-1).max().item()) if self.eos.numel() or limited else self.params.max_new_tokens
        tokens = self.res_tokens.masked_fill(mask == 0, self.params.pad_token_id)[:, :width]
        logprobs = (self.res_logprobs * mask)[:, :width]
        stats = {**self.loop_stats(), "rollout/new_tokens": float(mask.sum().item()),
                 "rollout/kv_bytes": float(eng.kv_bytes)}
        cut = None
        if self.CUTS and self.params.stop_at_rows > 0:
            cut = torch.zeros(len(self.prompts), dtype=torch.bool, device=eng.device)
            cut[self.cut] = True
            stats["rollout/cut_samples"] = float(len(self.cut))
        if eng.paged:
            per_page = eng.kv_bytes / eng.pool.pages
            stats.update({"rollout/preemptions": float(self.preempted),
                          "rollout/kv_pages_peak": float(eng.pool.peak),
                          "rollout/kv_bytes_peak": float(eng.pool.peak * per_page)})
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens,
                            response_mask=mask[:, :width], logprobs=logprobs, stats=stats, cut=cut)
