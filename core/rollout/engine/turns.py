"""Multi-turn generation in the engine: a turn ends, the environment answers, the sequence goes on
after the observation with its KV cache kept.

:class:`TurnScheduler` extends the continuous-batching :class:`~rlcore.rollout.engine.scheduler.Scheduler`:

* a turn ends at EOS or a stop string (one-token stop strings are flagged on the device with
  EOS; longer ones are found in the turn's text on the steps that read the flags); with the
  engine's ``lagged_turn_ends`` the flags and the rows' tokens are read from a copy taken without
  waiting for the device (:class:`_Snapshot`), once the device has passed it, for the slots that
  still serve the same request in the same turn (the turn then ends some steps later; the tokens
  decoded past its end are dropped as between checks, and keyed draws keep the episodes the same);
  the host then runs at most ``eos_check_interval`` decode steps ahead of the device (an event a
  step), so a copy is read within that many steps of being taken;
* the episode then *pauses*: its turn goes to the episode's environment through the
  :class:`~rlcore.envs.runner.EpisodeRunner` (a future, answered on the runner's thread) and the
  other slots keep decoding. With the paged KV cache the paused episode leaves the decode batch:
  its row is freed (it keeps its pages and its response so far), so that a waiting request is
  admitted there or the live rows are compacted into a smaller batch bucket. With the static
  cache its row holds its keys/values, so it stays and rides along in the decode steps, pinned
  (on the device) to its turn's last cache column, where the observation is written later;
* before each decode step the paused episodes whose environment answered are resumed together:
  their observations (rendered with the chat template) go after their turns' last tokens in ONE
  forward over the new tokens of all of them (:meth:`RolloutEngine._extend`, a ragged prefill
  of the new tokens only, the history read from the cache: no re-prefill of the context); with
  pages each gets a free row back (its pages written into the row's block table, more pages for
  the observation) and resumed episodes take free rows before new requests. When no row can
  decode and no request can be admitted, the loop waits for an environment;
* tokens are drawn with one uniform keyed by (seed, request, response column)
  (:func:`rlcore.rollout.sampling.keyed_uniforms`): an episode's tokens do not depend on which
  row it decodes in, on the other rows, or on when its environment answered; the paged and the
  static cache give the same episodes;
* an episode ends when the environment says so, at its turn limit, or when the response (model
  and observation tokens) would pass its token budget (``Episode.token_limit``: the episode's
  ``max_tokens``, at most ``max_new_tokens``); a slot whose turn used up the budget
  finishes at once, while its environment still sees that last turn (awaited before the result).
  A prompt without an episode ends at its first turn end.

With pages, a request is admitted only when the pool can hold every admitted request at its token
limit (pages are reserved, not taken, until used): an episode that has talked to its environment
cannot be preempted and sampled afresh, so it must never run out of pages.

The result marks model tokens in ``response_mask`` and every token of the sequence (observations
too) in ``response_attention``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad
from rlcore.rollout.engine.scheduler import PAGE_BATCH, PAGE_LOOKAHEAD, Scheduler
from rlcore.rollout.turns import find_turn_end

if TYPE_CHECKING:
    from rlcore.envs.runner import Episode
    from rlcore.rollout.engine import RolloutEngine


@dataclass
class _Pause:
    """An episode waiting for its environment: the observation's future, the response column of its
    turn's last token and that token; with the static cache its row, with pages the pages it holds."""

    future: concurrent.futures.Future
    end: int
    last: int
    row: Optional[int] = None
    pages: list[int] = field(default_factory=list)


class _Snapshot:
    """The turn-end flags and output tokens of slots ``0..n-1`` after decode step ``steps``, copied to
    the host without waiting (pinned memory and an event on CUDA; at once elsewhere), with the
    requests, birth steps and turn starts the slots held then (a slot read later must still hold
    them: the same request in the same turn; a request paused and resumed since, whose birth step may
    come out the same, has started another turn)."""

    def __init__(self, sched: "TurnScheduler", n: int):
        pinned = sched.eng.device.type == "cuda"
        self.n, self.steps = n, sched.steps
        self.reqs, self.born = list(sched.slot_req[:n]), list(sched.born[:n])
        self.turns = [None if r is None else sched.turn_start[r] for r in self.reqs]
        self.flags = torch.empty(n, dtype=torch.bool, pin_memory=pinned)
        self.tokens = torch.empty(n, sched.out_tokens.shape[1], dtype=torch.long, pin_memory=pinned)
        self.flags.copy_(sched.done[:n], non_blocking=pinned)
        self.tokens.copy_(sched.out_tokens[:n], non_blocking=pinned)
        self.event = None
        if pinned:
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class TurnScheduler(Scheduler):
    """One multi-turn ``generate`` call (see the module docstring).

    Args:
        episodes: per prompt, its :class:`~rlcore.envs.runner.Episode` or ``None`` (single turn).
        stop_ids, stop_texts: see :func:`rlcore.rollout.turns.stop_token_ids`.
        decode: ``token ids -> text`` (the tokenizer's, special tokens dropped).
    """

    CUTS = False  # an episode plays to its end (``stop_at_rows`` is for single-turn samples)

    def __init__(self, engine: "RolloutEngine", prompts: Sequence[Sequence[int]], params: SamplingParams,
                 episodes: Sequence[Optional["Episode"]], stop_ids: set[int], stop_texts: Sequence[str], decode):
        # each request's response budget: its episode's token limit (env.max_tokens), at most max_new_tokens
        limits = [int(params.max_new_tokens) if ep is None else ep.token_limit(params.max_new_tokens)
                  for ep in episodes]
        self.paused: dict[int, _Pause] = {}  # request -> its pause
        super().__init__(engine, prompts, params, limits=limits)
        self.episodes = list(episodes)
        self.end_ids = set(params.eos_token_ids) | set(stop_ids)
        self.eos = torch.tensor(sorted(self.end_ids), dtype=torch.long, device=engine.device)
        self.stop_texts = list(stop_texts)
        self.decode_text = decode
        n, cap, dev = len(prompts), engine.max_batch_size, engine.device
        self.turn_start = [0] * n  # response column where the request's current turn starts
        self.base_col = [0] * n  # cache column of response token 0 (the padded prompt width)
        self.low = [0] * n  # first cache column of the prompt (after its left padding)
        self.length = [0] * n  # response tokens of each finished request
        self.spans: list[list[tuple[int, int]]] = [[] for _ in prompts]  # observation columns [start, end)
        self.started: set[int] = set()  # requests whose environment has seen a turn (never preempted)
        self.reserved: dict[int, int] = {}  # pages reserved for each admitted request (paged)
        self.widest = max(len(p) for p in self.prompts)
        self.env_waits = 0
        self.env_wait_seconds = 0.0
        self.resumed = 0
        self.in_flight_peak = 0  # most requests admitted and not finished at once (decoding or paused)
        self.closing: list[concurrent.futures.Future] = []  # last turns of finished episodes, still with their environment
        self.row_key = torch.zeros(cap, dtype=torch.long, device=dev)  # request x response width, per row
        # lagged turn ends (engine.lagged_turn_ends): the copy in flight, and the rows it found done
        self.lagged = bool(getattr(engine, "lagged_turn_ends", False))
        self.snapshot: Optional[_Snapshot] = None
        self.seen: dict[int, tuple[list[int], int]] = {}  # slot -> (its tokens then, their count)
        # ... and, on CUDA, an event per decode step in flight: the host runs at most eos_check_interval
        # steps ahead of the device, so a snapshot is read within that many steps of being taken
        self.in_flight: collections.deque = collections.deque()
        self.step_event = torch.cuda.Event if self.lagged and engine.device.type == "cuda" else None
        if not engine.paged:  # paused rows pinned to their turn's last column
            self.pinned = torch.zeros(cap, dtype=torch.bool, device=dev)
            self.pin_at = torch.zeros(2, cap, dtype=torch.long, device=dev)  # cache column, position

    # -- sampling keyed by (request, response column)
    def _sample_admitted(self, logits: torch.Tensor, reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(logits, self._rows(reqs) * self.params.max_new_tokens)

    def _sample_step(self, logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(logits, self.row_key[:n] + self.out_col[:n])

    # -- admission (pages reserved at each request's token limit), compaction, bookkeeping
    def _worst(self, req: int) -> int:
        size = self.eng.page_size
        return min(-(-(self.widest + self.limit[req] + PAGE_LOOKAHEAD + PAGE_BATCH) // size),
                   -(-self.eng.max_seq_len // size))

    def _page_fit(self, limit: int) -> int:
        room = self.eng.pool.pages - 1 - sum(self.reserved.values())
        fit = 0
        for req in itertools.islice(self.queue, limit):
            room -= self._worst(req)
            if room < 0:
                break
            fit += 1
        return fit

    def _admit(self) -> None:
        before = set(self.live)
        super()._admit()
        new = [s for s in self.live if s not in before]
        for s in new:
            req = self.slot_req[s]
            self.turn_start[req] = 0
            self.base_col[req] = self.col0[s] + self.born[s]
            self.low[req] = self.base_col[req] - len(self.prompts[req])
            if self.eng.paged:
                self.reserved[req] = self._worst(req)
        self._set_keys(new)

    def _set_keys(self, rows: list[int]) -> None:
        if rows:
            self.row_key[self._rows(rows)] = self._rows([self.slot_req[s] for s in rows]) * self.params.max_new_tokens

    def _preempt(self, slot: int) -> None:
        req = self.slot_req[slot]
        if req in self.started:
            raise RuntimeError(f"rollout engine: the KV page pool ({self.eng.pool.pages} pages) ran out for a "
                               f"multi-turn episode that already talked to its environment")
        self.reserved.pop(req, None)
        super()._preempt(slot)

    def _moved(self, live: list[int], perm: torch.Tensor) -> None:
        """The paused rows, the rows' draw keys and (static cache) the pins follow the compaction."""
        where = {s: i for i, s in enumerate(live)}
        for pause in self.paused.values():
            if pause.row is not None:
                pause.row = where[pause.row]
        m = len(live)
        self.row_key[:m] = self.row_key.index_select(0, perm)
        if not self.eng.paged:
            self.pinned[:m] = self.pinned.index_select(0, perm)
            self.pin_at[:, :m] = self.pin_at.index_select(1, perm)
            self.pinned[m:] = False

    def _pinned_rows(self) -> set[int]:
        return {p.row for p in self.paused.values() if p.row is not None}

    def _relive(self) -> None:
        super()._relive()
        pinned = self._pinned_rows()
        self.in_flight_peak = max(self.in_flight_peak, len(self.live) + len(self.paused) - len(pinned))
        decoding = [s for s in self.live if s not in pinned]
        # the first step at which a decoding slot reaches its own budget; the attended length covers
        # the decoding slots and the turn ends the pinned ones stay at
        self.due = min((self.born[s] + self.limit[self.slot_req[s]] - 1 for s in decoding), default=0)
        self.max_col0 = max([self.col0[s] for s in decoding]
                            + [self.base_col[r] + p.end - self.steps for r, p in self.paused.items()
                               if p.row is not None], default=0)

    def _decoding(self) -> int:
        return len(self.live) - len(self._pinned_rows())

    def _pending(self) -> bool:
        return bool(self.queue or self.live or self.paused)

    # -- turn ends
    def _at_limit(self) -> list[int]:
        pinned = self._pinned_rows()
        return [s for s in self.live if s not in pinned and self._count(s) >= self.limit[self.slot_req[s]]]

    def _finished(self, n: int) -> list[int]:
        if self.lagged:
            return self._finished_lagged(n)
        finished = super()._finished(n)
        if self.stop_texts and self.steps % self.eng.eos_check_interval == 0:
            pinned = self._pinned_rows()
            candidates = [s for s in self.live if s not in pinned and s not in finished]
            if candidates:
                rows = self._read(self.out_tokens[self._rows(candidates)])
                for s, row in zip(candidates, rows):
                    count = min(self._count(s), len(row))
                    if find_turn_end(row, self.turn_start[self.slot_req[s]], count, set(), self.stop_texts,
                                     self.decode_text) is not None:
                        finished.append(s)
        return sorted(set(finished) - self._pinned_rows())

    def _launched(self) -> None:
        """Lagged turn ends: wait for the decode step ``eos_check_interval`` steps back before going on
        (without a bound the host runs as far ahead as the device's queue holds, and turn ends are seen
        that much later: more steps decoded past them, a longer episode)."""
        if self.step_event is None:
            return
        event = self.step_event()
        event.record()
        self.in_flight.append(event)
        if len(self.in_flight) > self.eng.eos_check_interval:
            self.in_flight.popleft().synchronize()

    def _finished_lagged(self, n: int) -> list[int]:
        """:meth:`_finished` without waiting for the device: the slots at their token limit, and those a
        snapshot taken some steps ago found at a turn's end (a slot still serving the same request
        since); a new snapshot is taken every ``eos_check_interval`` steps once the last was read."""
        finished = self._at_limit() if self.steps >= self.due else []
        snap, found = self.snapshot, []
        if snap is not None and snap.ready():
            self.snapshot = None
            flags, pinned = snap.flags.tolist(), self._pinned_rows()
            for s in self.live:
                req = self.slot_req[s]
                if (s >= snap.n or s in pinned or req != snap.reqs[s] or self.born[s] != snap.born[s]
                        or self.turn_start[req] != snap.turns[s]):
                    continue
                count = min(1 + snap.steps - snap.born[s], snap.tokens.shape[1])
                if not flags[s] and not self.stop_texts:
                    continue
                row = snap.tokens[s].tolist()
                if flags[s] or find_turn_end(row, self.turn_start[req], count, set(), self.stop_texts,
                                             self.decode_text) is not None:
                    self.seen[s] = (row, count)
                    found.append(s)
        if self.snapshot is None and self.live and self.steps % self.eng.eos_check_interval == 0:
            self.snapshot = _Snapshot(self, n)
        return sorted(set(finished) | set(found))

    def _finish(self, slots: list[int]) -> None:
        pinned = self._pinned_rows()
        slots = [s for s in slots if s not in pinned]
        seen, self.seen = self.seen, {}
        if not slots:
            return
        fresh = [s for s in slots if s not in seen]  # rows not read by a snapshot: read them now
        read = dict(zip(fresh, self._read(self.out_tokens[self._rows(fresh)]))) if fresh else {}
        over, pausing = [], []
        for s in slots:
            req = self.slot_req[s]
            limit = self.limit[req]
            row, count = seen[s] if s in seen else (read[s], self._count(s))
            count = min(count, limit)
            end = find_turn_end(row, self.turn_start[req], count, self.end_ids, self.stop_texts, self.decode_text)
            truncated = end is None
            if truncated:
                if count < limit:
                    continue  # a stale flag: the turn goes on
                end = limit - 1
            episode = self.episodes[req]
            turn = row[self.turn_start[req]:end + 1]
            if episode is None or end + 1 >= limit:
                if episode is not None:
                    # the budget is spent: the environment sees the last turn (for its reward) while
                    # the slot finishes now
                    self.closing.append(episode.turn_ended(turn, end + 1, limit, truncated=True))
                self.length[req] = end + 1
                over.append(s)
                continue
            self.started.add(req)
            self.paused[req] = _Pause(episode.turn_ended(turn, end + 1, limit, truncated), end, row[end], row=s)
            pausing.append(s)
        if over:
            self._close(over)
        if pausing:
            self._pause(pausing)
        self._relive()

    def _close(self, slots: list[int]) -> None:
        for s in slots:
            self.reserved.pop(self.slot_req[s], None)
        super()._finish(slots)

    def _pause(self, slots: list[int]) -> None:
        """Paged: the slots leave their rows (their responses so far kept in the result buffers, their
        pages with the pause). Static: they stay, pinned to their turns' last columns."""
        reqs = [self.slot_req[s] for s in slots]
        rows, index = self._rows(slots), self._rows(reqs)
        if self.eng.paged:
            self.res_tokens.index_copy_(0, index, self.out_tokens.index_select(0, rows))
            self.res_logprobs.index_copy_(0, index, self.out_logprobs.index_select(0, rows))
            for s, req, pages in zip(slots, reqs, self.eng._release(slots, keep_pages=True)):
                pause = self.paused[req]
                pause.row, pause.pages = None, pages
                self.slot_req[s] = None
            return
        ends = [self.paused[r].end for r in reqs]
        at = self._rows([self.base_col[r] + e for r, e in zip(reqs, ends)]
                        + [len(self.prompts[r]) + e for r, e in zip(reqs, ends)]).view(2, -1)
        self.pinned[rows] = True
        self.pin_at[:, rows] = at

    def _between_steps(self) -> None:
        """Continue (or end) the paused episodes whose environment answered; wait for one when no slot
        could decode or be admitted meanwhile."""
        while self.paused:
            ready = sorted(r for r, p in self.paused.items() if p.future.done())
            if ready and self.eng.paged and None not in self.slot_req:
                break  # no row to resume into: the batch is full
            if ready:
                self._resume(ready)
            if self._decoding() > 0 or self._should_admit() or not self.paused:
                break
            if any(p.future.done() for p in self.paused.values()):
                continue
            start = time.perf_counter()
            self.env_waits += 1
            concurrent.futures.wait([p.future for p in self.paused.values()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            self.env_wait_seconds += time.perf_counter() - start
        if not self.eng.paged and self.paused:  # decode steps advanced the pinned rows: back to their columns
            st = self.eng.state
            st.cache_index.copy_(torch.where(self.pinned, self.pin_at[0], st.cache_index))
            st.positions.copy_(torch.where(self.pinned, self.pin_at[1], st.positions))

    def _resume(self, reqs: list[int]) -> None:
        """Append the observations of ``reqs`` (their environments answered) in one forward and sample
        the next token of each; episodes that are over end here."""
        eng = self.eng
        going, ended = [], []
        for req in reqs:
            pause = self.paused[req]
            obs = pause.future.result()  # an environment error propagates here
            if obs is None or pause.end + 1 + len(obs) + 1 > self.limit[req]:
                ended.append(req)
            else:
                going.append((req, list(obs)))
        if ended:
            self._end_paused(ended)
        if eng.paged:  # rows for the resumed (the rest waits for one)
            free = [s for s, r in enumerate(self.slot_req) if r is None]
            going = going[:len(free)]
            rows = free[:len(going)]
        else:
            rows = [self.paused[req].row for req, _ in going]
        if not going:
            return
        pauses = [self.paused.pop(req) for req, _ in going]
        reqs = [req for req, _ in going]
        starts = [p.end + 1 for p in pauses]
        if eng.paged:
            self._give_pages(rows, reqs, pauses, [len(o) for _, o in going])
        else:
            self.pinned[self._rows(rows)] = False
        logits = eng._extend(rows, [[p.last] + obs for p, (_, obs) in zip(pauses, going)],
                             [self.base_col[r] + p.end for r, p in zip(reqs, pauses)],
                             [len(self.prompts[r]) + p.end for r, p in zip(reqs, pauses)],
                             [self.low[r] for r in reqs])
        width = self.params.max_new_tokens
        ks = [len(obs) for _, obs in going]
        keys = self._rows([r * width + a + k for r, a, k in zip(reqs, starts, ks)])
        tokens, logprobs = self.sample(logits, keys)
        self._write_resumed(rows, going, starts, tokens, logprobs)
        for s, req, a, k in zip(rows, reqs, starts, ks):
            self.slot_req[s] = req
            if k:
                self.spans[req].append((a, a + k))
            self.turn_start[req] = a + k
            # the slot now holds a + k + 1 response tokens; its next cache column follows them
            self.born[s] = self.steps - (a + k)
            self.col0[s] = self.base_col[req] + a + k - self.steps
        self._set_keys(rows)
        self.resumed += len(rows)
        self._relive()
        # a resumed slot whose sampled token used up its budget ends before it decodes on
        self._finish([s for s in rows if self._count(s) >= self.limit[self.slot_req[s]]])

    def _give_pages(self, rows: list[int], reqs: list[int], pauses: list[_Pause], ks: list[int]) -> None:
        """Paged: the resumed episodes' pages (and more for their observations) into rows ``rows``, and
        their responses so far back into the rows' output buffers."""
        eng = self.eng
        size, most = eng.page_size, -(-eng.max_seq_len // eng.page_size)
        for req, pause, k in zip(reqs, pauses, ks):
            end = self.base_col[req] + pause.end + 1 + k + PAGE_LOOKAHEAD
            pause.pages += eng.pool.take(max(0, min(-(-end // size), most) - len(pause.pages)))
        eng._set_pages(rows, [p.pages for p in pauses])
        index, at = self._rows(reqs), self._rows(rows)
        self.out_tokens[at] = self.res_tokens.index_select(0, index)
        self.out_logprobs[at] = self.res_logprobs.index_select(0, index)

    def _write_resumed(self, rows: list[int], going: list[tuple[int, list[int]]], starts: list[int],
                       tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Observation tokens (log-prob 0) and the sampled token into the rows' outputs; the rows decode on."""
        width = self.params.max_new_tokens
        obs_at = [s * width + a + i for s, a, (_, obs) in zip(rows, starts, going) for i in range(len(obs))]
        if obs_at:
            at = self._rows(obs_at)
            self.out_tokens.view(-1).index_copy_(0, at, self._rows([t for _, obs in going for t in obs]))
            self.out_logprobs.view(-1).index_fill_(0, at, 0.0)
        nxt = [a + len(obs) for a, (_, obs) in zip(starts, going)]
        at = self._rows([s * width + c for s, c in zip(rows, nxt)])
        self.out_tokens.view(-1).index_copy_(0, at, tokens)
        self.out_logprobs.view(-1).index_copy_(0, at, logprobs.float())
        index = self._rows(rows)
        self.out_col[index] = self._rows([c + 1 for c in nxt])
        self.eng.state.tokens[index] = tokens
        self.done[index] = torch.isin(tokens, self.eos)

    def _end_paused(self, reqs: list[int]) -> None:
        """Episodes over while paused (the environment ended them, or the observation would pass the
        budget): their responses end at their turns' last tokens."""
        rows = []
        for req in reqs:
            pause = self.paused.pop(req)
            self.length[req] = pause.end + 1
            if pause.row is None:  # paged: the response is in the result buffers already
                self.eng.pool.drop(pause.pages)
                self.reserved.pop(req, None)
            else:
                rows.append(pause.row)
        if rows:
            self.pinned[self._rows(rows)] = False
            self._close(rows)

    def result(self) -> RolloutBatch:
        for future in self.closing:  # every episode's last step is done (an environment error propagates)
            future.result()
        eng = self.eng
        prompt_ids, prompt_mask = left_pad(self.prompts, self.params.pad_token_id, eng.device)
        width = max(max(self.length, default=1), 1)
        lengths = torch.tensor(self.length, dtype=torch.long, device=eng.device)
        attention = (torch.arange(width, device=eng.device)[None] < lengths[:, None]).long()
        model = attention.clone()
        for req, spans in enumerate(self.spans):
            for a, b in spans:
                model[req, a:b] = 0
        tokens = self.res_tokens[:, :width].masked_fill(attention == 0, self.params.pad_token_id)
        logprobs = self.res_logprobs[:, :width] * model
        stats = {**self.loop_stats(), "rollout/new_tokens": float(model.sum().item()),
                 "rollout/observation_tokens": float((attention - model).sum().item()),
                 "rollout/env_waits": float(self.env_waits), "rollout/env_wait_seconds": self.env_wait_seconds,
                 "rollout/resumed": float(self.resumed), "rollout/in_flight_peak": float(self.in_flight_peak),
                 "rollout/kv_bytes": float(eng.kv_bytes)}
        if eng.paged:
            stats.update({"rollout/preemptions": float(self.preempted), "rollout/kv_pages_peak": float(eng.pool.peak)})
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens,
                            response_mask=model, logprobs=logprobs, stats=stats, response_attention=attention)
