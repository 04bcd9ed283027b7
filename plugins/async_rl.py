"""The ``async`` plugin: rollout and training on separate ranks, overlapped, with bounded staleness.

``rlcore train --plugins async`` under a launcher of ``W`` processes splits the job
(``rlcore_world_split``): the last ``R`` ranks generate, the first ``T = W - R`` train (FSDP over
the training ranks only; see :mod:`rlcore.distributed.split`). Settings (``plugin_config.async``):

* ``rollout_ranks`` — how many ranks generate (0: ``rollout_fraction`` of the job, at least one);
* ``rollout_fraction`` — the share of ranks that generate when ``rollout_ranks`` is 0 (0.25);
* ``max_staleness`` — how many optimizer steps older than the policy being trained a sample's
  weights may be (default 1: one-step off-policy; 0: synchronous, for comparison);
* ``bucket_mb`` — the size of the flat buffers the weights travel in;
* ``weights_backend`` — ``auto`` (NCCL on GPUs, gloo through the host on CPUs), ``gloo`` or ``nccl``.

The protocol
------------
Bridge rank 0 is training rank 0; bridge ranks ``1 .. R`` are the rollout ranks. A gloo send
completes only once its receiver has posted the receive, so the two sides never wait on each other
in a send: a rollout rank receives in a thread of its own (always ready for the next request), sends
its results in another, and generates in its main thread; training rank 0 does everything in order
in the training loop. Per rank, in order:

*training rank 0* (the other training ranks take part in the collectives marked ``[T]`` only)::

    first step:   -> init (model config, dtype, backend)                  to every rollout rank
    step k:       for each step j not yet queued, k <= j <= min(k + s, max_steps):
                      [T] gather the full weights (FSDP all-gather)           once per version
                      -> ("weights", k - 1, plan); [bridge broadcast] buckets once per version
                      [T] gather the prompts of step j on rank 0
                      -> ("generate", j, prompts of rollout rank i, params)  to rollout rank i
                  <- ("result", k, version, samples)                       from every rollout rank, in order
                  [T] scatter each training rank's rows
    end of run:   -> ("stop",)                to every rollout rank (also after a run that trained no step)
                  <- one ("result" | "dropped", j) per queued step j       from every rollout rank

*rollout rank* (receiver thread: the messages above into a FIFO inbox, the weights' buckets taken by
the broadcast as they arrive; main thread: the inbox in order; sender thread: the replies in order)::

    init -> build the model on the meta device (every tensor comes from the trainers)
    weights -> copy the buckets into the model (between two generation calls) and refresh the backend
    generate j -> generate (one generation micro-batch at a time); reply ("result", j, version, samples),
                  or ("dropped", j) once "stop" has arrived
    stop -> reply "dropped" to every generate still queued, then exit 0

Every collective is entered by all its members in the same order: the ``[T]`` steps depend only on
``k``, ``s`` and ``max_steps``, the same on every training rank; the bridge broadcasts follow their
"weights" message on both sides. Shutdown is a message: the trainers answer every queued step, so
no send is left without its receive. A rollout rank ignores SIGINT/SIGTERM (the trainers finish
their step, save and stop it); one that dies fails training rank 0's next bridge operation with an
error naming it.

Staleness: the samples of step ``k`` were generated with the weights of version ``k - 1 - s`` (or
``0`` for the first ``s`` steps), while step ``k`` trains the policy of version ``k - 1``: the
staleness is ``min(s, k - 1)``, and at most ``s + 1`` steps are in flight. The update corrects for it
with the rollout importance weight (``ppo.rollout_is``, required when ``max_staleness > 0``), whose
behaviour policy is the one that generated each sample (the samples carry its log-probs).

Checkpoints: the data position saved is the one before the oldest step drawn but not yet trained
on, so a resumed run draws the queued prompts again — none is lost or trained twice — and the
version counter is the trainer's step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlcore.errors import ConfigError, PlacementError
from rlcore.hookspecs import hookimpl

log = logging.getLogger(__name__)

NAME = "async"


@dataclass
class AsyncSettings:
    """``plugin_config.async``."""

    rollout_ranks: int = 0
    rollout_fraction: float = 0.25
    max_staleness: int = 1
    bucket_mb: int = 64
    weights_backend: str = "auto"


settings_schema = AsyncSettings


def check_settings(s: AsyncSettings) -> None:
    """The ranges of the settings (their types are checked against :class:`AsyncSettings`)."""
    checks = [(s.rollout_ranks >= 0, "rollout_ranks", "an integer >= 0"),
              (0.0 < float(s.rollout_fraction) < 1.0, "rollout_fraction", "a number in (0, 1)"),
              (s.max_staleness >= 0, "max_staleness", "an integer >= 0"),
              (s.bucket_mb >= 1, "bucket_mb", "an integer >= 1"),
              (s.weights_backend in ("auto", "gloo", "nccl"), "weights_backend", "auto, gloo or nccl")]
    bad = [f"'plugin_config.{NAME}.{key}' = {getattr(s, key)!r} must be {want}" for ok, key, want in checks if not ok]
    if bad:
        raise ConfigError(bad)


def check_run(config: dict[str, Any], s: AsyncSettings) -> None:
    """What the rest of the config must be for an asynchronous run."""
    check_settings(s)
    ppo, algo, data = config.get("ppo") or {}, config.get("algorithm") or {}, config.get("data") or {}
    problems = []
    if s.max_staleness > 0 and str(ppo.get("rollout_is", "none")) == "none":
        problems.append(f"plugin '{NAME}' with 'plugin_config.{NAME}.max_staleness' = {s.max_staleness} trains on "
                        "samples of an older policy: set 'ppo.rollout_is' to token or sequence (the clipped "
                        "importance weight that corrects for it), or max_staleness to 0")
    # what the rollout ranks do not do: generate greedily beside the samples, draw more rounds, play episodes
    if str(algo.get("adv_estimator")) == "remax":
        problems.append(f"plugin '{NAME}' does not run algorithm.adv_estimator=remax (its greedy baseline is "
                        "generated with the step's samples); use grpo, rloo or gae")
    if (algo.get("dynamic_sampling") or {}).get("enable"):
        problems.append(f"plugin '{NAME}' does not run algorithm.dynamic_sampling (its extra rounds are drawn "
                        "after scoring); turn it off")
    if data.get("env_key"):
        problems.append(f"plugin '{NAME}' does not play multi-turn episodes (data.env_key); unset it")
    if problems:
        raise ConfigError(problems)
    nproc = int((config.get("trainer") or {}).get("nproc_per_node", 1) or 1)
    if nproc > 1:  # rlcore's own launcher: the world size is known before any process starts
        rollout_rank_count(nproc, s)


def rollout_rank_count(world_size: int, s: AsyncSettings) -> int:
    """How many of ``world_size`` ranks generate."""
    if world_size < 2:
        raise PlacementError(f"plugin '{NAME}' runs generation and training on separate ranks: start at least 2 "
                             f"processes (torchrun --nproc_per_node=N or trainer.nproc_per_node=N), not {world_size}")
    n = s.rollout_ranks or max(1, round(world_size * float(s.rollout_fraction)))
    if n >= world_size:
        raise PlacementError(f"'plugin_config.{NAME}.rollout_ranks' = {n} leaves no training rank in a job of "
                             f"{world_size} processes")
    return n


@hookimpl
def rlcore_preflight(config, settings):
    check_run(config, settings)


@hookimpl
def rlcore_world_split(world_size, settings):
    check_settings(settings)
    return AsyncSplit(settings, rollout_rank_count(world_size, settings))


class AsyncSplit:
    """The plugin's :class:`~rlcore.protocols.WorldSplit`."""

    def __init__(self, settings: AsyncSettings, rollout_ranks: int):
        self.settings, self.rollout_ranks = settings, rollout_ranks
        self.weights_backend = settings.weights_backend

    def run_rollout_rank(self, config: Any, split: Any, pm: Any) -> int:
        return RolloutWorker(split, pm).run()

    def rollout_source(self, trainer: Any, split: Any) -> "AsyncSource":
        return AsyncSource(trainer, split, self.settings)


# ----------------------------------------------------------------------------------------------
# weights across the bridge
# ----------------------------------------------------------------------------------------------

_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def full_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every parameter and buffer of ``module``'s state dict. Sharded
    (DTensor) entries are gathered, a collective over the training ranks: every training rank calls
    this in the same order."""
    out, seen = [], set()
    for name, t in module.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append((_clean(name), t.detach()))
        seen.add(_clean(name))
    # buffers kept out of the state dict (RoPE frequencies, ...): the rollout model is built empty
    out += [(_clean(name), b.detach()) for name, b in module.named_buffers() if _clean(name) not in seen]
    return out


def plan_buckets(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[tuple[str, list[tuple]]]:
    """Consecutive tensors of one dtype grouped into buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own): ``[(dtype name, [(name, shape), ...]), ...]``."""
    buckets: list[tuple[str, list[tuple]]] = []
    size = 0
    for name, t in items:
        dtype = str(t.dtype).replace("torch.", "")
        nbytes = t.numel() * t.element_size()
        if not buckets or buckets[-1][0] != dtype or size + nbytes > bucket_bytes:
            buckets.append((dtype, []))
            size = 0
        buckets[-1][1].append((name, tuple(t.shape)))
        size += nbytes
    return buckets


def send_weights(bridge: Any, items: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int) -> float:
    """Training rank 0: announce version ``version`` to every rollout rank, then broadcast the
    buckets. Returns the seconds it took."""
    t0 = time.perf_counter()
    plan = plan_buckets(items, bucket_bytes)
    for peer in range(1, bridge.size):
        bridge.send(("weights", version, plan), peer)
    tensors = dict(items)
    for _, entries in plan:
        flat = torch.cat([tensors[name].reshape(-1).to(bridge.weights_device) for name, _ in entries])
        bridge.broadcast([flat], src=0)
    return time.perf_counter() - t0


def receive_buckets(bridge: Any, plan: list[tuple[str, list[tuple]]]) -> list[torch.Tensor]:
    """A rollout rank: the flat buckets announced by ``plan``, taken from the bridge's broadcast."""
    flats = []
    for dtype, entries in plan:
        flat = torch.empty(sum(int(torch.Size(shape).numel()) for _, shape in entries), dtype=getattr(torch, dtype),
                           device=bridge.weights_device)
        bridge.broadcast([flat], src=0)
        flats.append(flat)
    return flats


def load_buckets(plan: list[tuple[str, list[tuple]]], flats: list[torch.Tensor], model: torch.nn.Module) -> None:
    """Copy received buckets into ``model``'s parameters and buffers (names as :func:`full_weights`'s)."""
    own = {_clean(k): v for k, v in model.named_buffers()}
    own.update({_clean(k): v for k, v in model.state_dict().items()})
    missing = [name for _, entries in plan for name, _ in entries if name not in own]
    if missing:
        raise RuntimeError(f"plugin '{NAME}': the rollout model has no tensor named {missing[0]!r} "
                           f"({len(missing)} missing): the training and rollout models differ")
    with torch.no_grad():
        for (_, entries), flat in zip(plan, flats):
            numel = [int(torch.Size(shape).numel()) for _, shape in entries]
            for (name, shape), part in zip(entries, torch.split(flat, numel)):
                own[name].copy_(part.view(shape))


# ----------------------------------------------------------------------------------------------
# the training ranks' side
# ----------------------------------------------------------------------------------------------


class _Position:
    """The data position a checkpoint holds: before the oldest step drawn but not yet trained on."""

    def __init__(self, source: "AsyncSource"):
        self.source = source

    def state_dict(self) -> dict[str, Any]:
        pending = self.source.pending
        if pending:
            return copy.deepcopy(pending[min(pending)][0])
        return self.source.filler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.filler.load_state_dict(state)


class AsyncSource:
    """A training rank's :class:`~rlcore.protocols.RolloutSource`: prompts go to the rollout ranks,
    samples come back up to ``max_staleness`` steps later (the protocol is in the module docstring)."""

    def __init__(self, trainer: Any, split: Any, settings: AsyncSettings):
        self.trainer, self.split, self.settings = trainer, split, settings
        self.filler = trainer.c.prompts.fill
        self.bridge = split.bridge  # training rank 0 only
        self.staleness = int(settings.max_staleness)
        self.max_steps = int(trainer.tcfg.max_steps)
        #: step -> (data position before its prompts, their extras), for the steps queued and not yet
        #: trained on; on every training rank
        self.pending: dict[int, tuple[dict[str, Any], dict[str, list]]] = {}
        self.counts: dict[int, list[int]] = {}  # training rank 0: queued step -> prompts per training rank
        self.submitted = 0  # the newest queued step
        self.started = False
        self.closed = False  # the rollout ranks were told to stop
        self.sent_version: Optional[int] = None  # the newest weights sent to the rollout ranks
        self._metrics: dict[str, float] = {}
        self._weights_s = 0.0

    def next(self, step: int) -> Any:
        from rlcore.trainer.loop import Sampled

        t = self.trainer
        if not self.started:
            self._start()
        for j in range(max(self.submitted + 1, step), min(step + self.staleness, self.max_steps) + 1):
            if self.sent_version != step - 1:
                self._publish(step - 1)
            self._submit(j)
        t0 = time.perf_counter()
        with t.timer("generate"):  # the wait for the samples: generation time not hidden behind training
            rollout, version = self._receive(step)
        wait = time.perf_counter() - t0
        _, extras = self.pending.pop(step)
        t.hook.rlcore_after_generation(step=step, rollout=rollout)
        lag = (step - 1) - version
        if not 0 <= lag <= self.staleness:  # cannot happen by construction; such samples must not train
            raise RuntimeError(f"plugin '{NAME}': the samples of step {step} come from policy version {version}, "
                               f"{lag} steps old, outside 0..max_staleness={self.staleness}")
        with t.timer("reward"):
            raw, m_reward = t.score(rollout, extras)
        scores, shaping = t.shape_scores(rollout, raw)
        m_reward.update(shaping)
        self._metrics = {"async/staleness": float(lag), "async/policy_version": float(version),
                         "async/wait_s": wait, "async/weights_sync_s": self._weights_s,
                         "async/queued_steps": float(len(self.pending))}
        self._weights_s = 0.0
        groups = torch.arange(rollout.batch_size // t.n).repeat_interleave(t.n)  # n samples of each prompt in a row
        return Sampled(rollout=rollout, scores=scores, raw_scores=raw, reward_metrics=m_reward,
                       truncated=t.truncated(rollout), group_ids=groups)

    def data_state(self) -> _Position:
        return _Position(self)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self, failed: bool = False) -> None:
        """Stop the rollout ranks: send "stop", then take one answer per queued step from each (the
        samples are dropped: their prompts are drawn again on resume). A run that trained no step
        (resumed at ``max_steps``: nothing to do) stops them too, so they exit 0 with the trainers.
        After a failure, a rollout rank that cannot be reached is logged, not raised (the run's own
        error goes on). Called once; a second call does nothing."""
        if self.bridge is None or self.closed:
            return
        self.started, self.closed = False, True
        try:
            for peer in range(1, self.bridge.size):
                self.bridge.send(("stop",), peer)
            for step in sorted(self.counts):
                for peer in range(1, self.bridge.size):
                    kind, got, *_ = self.bridge.recv(peer)
                    if got != step:
                        raise RuntimeError(f"plugin '{NAME}': {self.bridge.names[peer]} answered step {got} while "
                                           f"stopping, expected step {step}")
            self.counts.clear()
        except Exception as error:
            if not failed:
                raise
            log.warning("plugin '%s': the rollout ranks could not be stopped cleanly: %s", NAME, error)

    # -- steps -----------------------------------------------------------------------------------
    def _start(self) -> None:
        t, c = self.trainer, self.trainer.c
        self.started = True
        if self.bridge is None:
            return
        from omegaconf import OmegaConf

        from rlcore.trainer.components import rollout_request

        model = c.policy
        request = rollout_request(*(OmegaConf.to_object(t.cfg[key]) for key in ("actor", "data", "ppo")))
        init = {"config": model.config, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                "request": request, "micro_batch": int(t.gen_cfg.batch_size)}
        for peer in range(1, self.bridge.size):
            self.bridge.send(("init", init), peer)

    def _publish(self, version: int) -> None:
        with self.trainer.timer("weights_sync"):
            items = full_weights(self.trainer.c.policy)  # a collective over the training ranks
            if self.bridge is not None:
                self._weights_s += send_weights(self.bridge, items, version, int(self.settings.bucket_mb) << 20)
        self.sent_version = version

    def _submit(self, step: int) -> None:
        from rlcore.distributed.init import gather_object

        t, c = self.trainer, self.trainer.c
        before = copy.deepcopy(self.filler.state_dict())
        rows = self.filler(c.prompts.loader.next_batch())
        prompts, extras = t.expand(rows)
        t.hook.rlcore_before_generation(step=step, prompts=prompts)
        self.pending[step] = (before, extras)
        everyone = gather_object(prompts, 0)  # a collective over the training ranks
        self.submitted = step
        if self.bridge is None:
            return
        flat = [p for part in everyone for p in part]
        self.counts[step] = [len(part) for part in everyone]
        params = t.sampling(step)
        peers = self.bridge.size - 1
        for i in range(peers):
            chunk = flat[i * len(flat) // peers:(i + 1) * len(flat) // peers]
            seed = None if params.seed is None else params.seed + 7919 * i
            self.bridge.send(("generate", step, chunk, dataclasses.replace(params, seed=seed)), 1 + i)

    def _receive(self, step: int):
        from rlcore.distributed.init import scatter_object
        from rlcore.rollout.base import concat_batches

        parts = None
        if self.bridge is not None:
            got = [self.bridge.recv(peer) for peer in range(1, self.bridge.size)]
            for peer, (kind, got_step, *_) in enumerate(got, start=1):
                if kind != "result" or got_step != step:
                    raise RuntimeError(f"plugin '{NAME}': expected the samples of step {step} from "
                                       f"{self.bridge.names[peer]}, got {kind} of step {got_step}")
            version = min(g[2] for g in got)
            pad = int(self.trainer.c.tokenizer.pad_token_id)
            batch = concat_batches([g[3] for g in got if g[3] is not None], pad)
            counts, parts, start = self.counts.pop(step), [], 0
            for n in counts:
                parts.append((_take(batch, start, start + n), version))
                start += n
        return scatter_object(parts, 0)  # a collective over the training ranks


def _take(batch: Any, a: int, b: int) -> Any:
    """Rows ``a:b`` of a rollout batch."""
    rows = {f.name: getattr(batch, f.name)[a:b] for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **rows, stats=dict(batch.stats))


# ----------------------------------------------------------------------------------------------
# the rollout ranks' side
# ----------------------------------------------------------------------------------------------


class _Stopped(Exception):
    """A generation cut short: "stop" arrived while it ran."""


class RolloutWorker:
    """A rollout rank: wait for the model, then generate whatever training rank 0 queues, taking new
    weights between two generation calls, until told to stop (see the module docstring)."""

    def __init__(self, split: Any, pm: Any):
        self.split, self.bridge, self.pm = split, split.bridge, pm
        self.device = split.dist.device
        self.model: Optional[torch.nn.Module] = None
        self.backend: Any = None
        self.init: dict[str, Any] = {}
        self.version = -1
        self.micro = 1
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the trainers stop this rank once they have saved
            signal.signal(sig, lambda *_: log.info("rollout rank: signal noted; the trainers will stop this rank"))
        log.info("rollout rank %d of %d: waiting for the model", self.split.dist.rank, self.split.rollout_ranks)
        receiver = threading.Thread(target=self._receive_loop, name="rlcore-async-recv", daemon=True)
        sender = threading.Thread(target=self._send_loop, name="rlcore-async-send", daemon=True)
        receiver.start()
        sender.start()
        while True:
            msg = self.inbox.get()
            kind = msg[0]
            if kind == "error":
                raise msg[1]
            if kind == "init":
                self._build(msg[1])
            elif kind == "weights":
                load_buckets(msg[2], msg[3], self.model)
                self.version = int(msg[1])
                if self.backend is None:
                    self._make_backend()
                else:
                    self.backend.sync_weights()
            elif kind == "generate":
                step = msg[1]
                try:
                    if self.stopping.is_set():
                        raise _Stopped
                    self.outbox.put(("result", step, self.version, self._generate(msg[2], msg[3])))
                except _Stopped:
                    self.outbox.put(("dropped", step))
            elif kind == "stop":
                self.outbox.put(None)
                sender.join()
                if self.inbox.qsize() and self.inbox.queue[0][0] == "error":
                    raise self.inbox.get()[1]
                log.info("rollout rank %d: stopped", self.split.dist.rank)
                return 0
            else:
                raise RuntimeError(f"plugin '{NAME}': rollout rank got an unknown message {kind!r}")

    def _receive_loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        try:
            while True:
                msg = self.bridge.recv(0, timeout=None)  # the trainers take as long as they need
                if msg[0] == "weights":
                    msg = (*msg, receive_buckets(self.bridge, msg[2]))
                elif msg[0] == "stop":
                    self.stopping.set()
                self.inbox.put(msg)
                if msg[0] == "stop":
                    return
        except Exception as error:  # noqa: BLE001 - handed to the main thread, which raises it
            self.stopping.set()
            self.inbox.put(("error", error))

    def _send_loop(self) -> None:
        try:
            while (item := self.outbox.get()) is not None:
                self.bridge.send(item, 0, timeout=None)  # training rank 0 takes the samples when its step needs them
        except Exception as error:  # noqa: BLE001 - handed to the main thread, which raises it
            self.stopping.set()
            self.inbox.put(("error", error))

    def _build(self, init: dict[str, Any]) -> None:
        from transformers import AutoModelForCausalLM

        self.init = init
        self.micro = max(1, int(init["micro_batch"]))
        with torch.device("meta"):  # no random initialisation: every tensor comes from the trainers
            model = AutoModelForCausalLM.from_config(init["config"], dtype=getattr(torch, init["dtype"]))
        model = model.to_empty(device=self.device)
        model.tie_weights()
        self.model = model.eval()

    def _make_backend(self) -> None:
        request = self.init["request"]
        request = dataclasses.replace(request, engine={**dict(request.engine), "device": self.device})
        self.backend = self.pm.build("rlcore_rollout_backend", model=self.model, request=request, dist=self.split.dist)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: Any) -> Any:
        """Samples of ``prompts`` on the host (``None`` for none), one generation micro-batch at a time.

        :raises _Stopped: "stop" arrived between two micro-batches."""
        from rlcore.rollout.base import concat_batches

        parts = []
        for i in range(0, len(prompts), self.micro):
            if self.stopping.is_set():
                raise _Stopped
            out = self.backend.generate(prompts[i:i + self.micro], params)
            parts.append(dataclasses.replace(out, prompt_ids=out.prompt_ids.cpu(), prompt_mask=out.prompt_mask.cpu(),
                                             response_ids=out.response_ids.cpu(),
                                             response_mask=out.response_mask.cpu(), logprobs=out.logprobs.cpu()))
        return concat_batches(parts, int(params.pad_token_id)) if parts else None
