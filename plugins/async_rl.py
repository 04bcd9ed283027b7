"""The ``async`` plugin: rollout and training on separate ranks, overlapped, with bounded staleness.

``rlcore train --plugins async`` under a launcher of ``W`` processes splits the job
(``rlcore_world_split``): the last ``R`` ranks generate, the first ``T = W - R`` train (FSDP over
the training ranks only; see :mod:`rlcore.distributed.split`). Settings (``plugin_config.async``):

* ``rollout_ranks`` — how many ranks generate (0: ``rollout_fraction`` of the job, at least one);
* ``rollout_fraction`` — the share of ranks that generate when ``rollout_ranks`` is 0 (0.25);
* ``max_staleness`` — how many optimizer steps older than the policy being trained a sample's
  weights may be (default 1: one-step off-policy; 0: synchronous, for comparison);
* ``bucket_mb`` — the size of the flat buffers the weights travel in.

How a step goes, for step ``k`` with staleness ``s``:

1. the training ranks send the weights of version ``k - 1`` to the rollout ranks (gathered from the
   training shards once, broadcast in buckets over the bridge; the rollout ranks take them between
   two generation calls, so generation stops no longer than the copy);
2. the training ranks draw the prompts of step ``k + s`` and queue them at the rollout ranks;
3. they receive the samples of step ``k`` (generated with weights of version ``k - 1 - s`` or
   newer), each carrying its policy version and its rollout log-probs;
4. they score and train on them while the rollout ranks already generate step ``k + 1``.

The update corrects for the staleness with the rollout importance weight (``ppo.rollout_is``, the
same correction as for the rollout/trainer mismatch), whose behaviour policy is the one that
generated each sample. The queue is bounded by construction: at most ``s + 1`` steps are in flight.

Checkpoints: the data position saved is the one before the oldest step drawn but not yet trained
on, so a resumed run draws the queued prompts again — none is lost or trained twice — and the
version counter is the trainer's step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
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


def settings_from(config: dict[str, Any]) -> AsyncSettings:
    """The plugin's settings from the resolved config, checked; errors name ``plugin_config.async.<key>``."""
    raw = dict((config.get("plugin_config") or {}).get(NAME) or {})
    fields = {f.name for f in dataclasses.fields(AsyncSettings)}
    problems = [f"'plugin_config.{NAME}.{key}' is not a setting of plugin '{NAME}' (settings: "
                f"{', '.join(sorted(fields))})" for key in raw if key not in fields]
    if problems:
        raise ConfigError(problems)
    s = AsyncSettings(**raw)
    checks = [(isinstance(s.rollout_ranks, int) and s.rollout_ranks >= 0, "rollout_ranks", "an integer >= 0"),
              (0.0 < float(s.rollout_fraction) < 1.0, "rollout_fraction", "a number in (0, 1)"),
              (isinstance(s.max_staleness, int) and s.max_staleness >= 0, "max_staleness", "an integer >= 0"),
              (isinstance(s.bucket_mb, int) and s.bucket_mb >= 1, "bucket_mb", "an integer >= 1")]
    bad = [f"'plugin_config.{NAME}.{key}' = {getattr(s, key)!r} must be {want}" for ok, key, want in checks if not ok]
    if bad:
        raise ConfigError(bad)
    return s


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
def rlcore_preflight(config, plugins):
    if NAME in plugins:
        settings_from(config)


@hookimpl
def rlcore_world_split(world_size, config):
    s = settings_from(config)
    return AsyncSplit(s, rollout_rank_count(world_size, s))


class AsyncSplit:
    """The plugin's :class:`~rlcore.protocols.WorldSplit`."""

    def __init__(self, settings: AsyncSettings, rollout_ranks: int):
        self.settings, self.rollout_ranks = settings, rollout_ranks

    def run_rollout_rank(self, config: Any, split: Any) -> int:
        return RolloutWorker(config, split).run()

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
        flat = torch.cat([tensors[name].reshape(-1).to("cpu") for name, _ in entries])
        bridge.broadcast([flat], src=0)
    return time.perf_counter() - t0


def receive_weights(bridge: Any, plan: list[tuple[str, list[tuple]]], model: torch.nn.Module) -> None:
    """A rollout rank: take the buckets announced by ``plan`` into ``model``'s parameters and buffers."""
    own = {_clean(k): v for k, v in model.named_buffers()}
    own.update({_clean(k): v for k, v in model.state_dict().items()})
    missing = [name for _, entries in plan for name, _ in entries if name not in own]
    if missing:
        raise RuntimeError(f"plugin '{NAME}': the rollout model has no tensor named {missing[0]!r} "
                           f"({len(missing)} missing): the training and rollout models differ")
    with torch.no_grad():
        for dtype, entries in plan:
            numel = [int(torch.Size(shape).numel()) for _, shape in entries]
            flat = torch.empty(sum(numel), dtype=getattr(torch, dtype))
            bridge.broadcast([flat], src=0)
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
    samples come back one step later (see the module docstring)."""

    def __init__(self, trainer: Any, split: Any, settings: AsyncSettings):
        self.trainer, self.split, self.settings = trainer, split, settings
        self.filler = trainer.c.ensure_ids
        self.bridge = split.bridge  # training rank 0 only
        self.staleness = int(settings.max_staleness)
        self.max_steps = int(trainer.tcfg.max_steps)
        #: step -> (data position before its prompts, their extras); on every training rank
        self.pending: dict[int, tuple[dict[str, Any], dict[str, list]]] = {}
        self.counts: dict[int, list[int]] = {}  # training rank 0: step -> prompts per training rank
        self.submitted = 0
        self.version: Optional[int] = None  # the weights the rollout ranks hold
        self._metrics: dict[str, float] = {}
        self._weights_s = 0.0

    # -- the protocol ----------------------------------------------------------------------------
    def next(self, step: int):
        if self.version is None:
            self._start(step)
        elif self.version != step - 1:
            self._push_weights(step - 1)
        for j in range(max(self.submitted + 1, step), min(step + self.staleness, self.max_steps) + 1):
            self._submit(j)
        t0 = time.perf_counter()
        rollout, version = self._receive(step)
        wait = time.perf_counter() - t0
        _, extras = self.pending.pop(step)
        self.trainer.hook.rlcore_after_generation(step=step, rollout=rollout)
        self.trainer._times["generate"] = self.trainer._times.get("generate", 0.0) + wait
        lag = (step - 1) - version
        if lag > self.staleness:  # cannot happen by construction; a sample past the bound must not train
            raise RuntimeError(f"plugin '{NAME}': samples of step {step} come from policy version {version}, "
                               f"{lag} steps old, beyond max_staleness={self.staleness}")
        self._metrics = {"async/staleness": float(lag), "async/policy_version": float(version),
                         "async/wait_s": wait, "async/weights_sync_s": self._weights_s,
                         "async/queued_steps": float(len(self.pending))}
        self._weights_s = 0.0
        return rollout, extras

    def data_state(self) -> _Position:
        return _Position(self)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        """Take the samples still queued (they are dropped: their prompts are drawn again on resume)
        and stop the rollout ranks."""
        if self.bridge is None or self.version is None:
            return
        for step in sorted(self.counts):
            for peer in range(1, self.bridge.size):
                self.bridge.recv(peer)
        self.counts.clear()
        for peer in range(1, self.bridge.size):
            self.bridge.send(("stop",), peer)
        self.version = None

    # -- steps -----------------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        t, c = self.trainer, self.trainer.c
        if self.bridge is not None:
            model = c.actor_module
            init = {"config": model.config, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                    "backend": str(t.cfg.actor.rollout_backend), "engine": _engine_kwargs(t.cfg),
                    "micro_batch": int(t.gen_cfg.batch_size)}
            for peer in range(1, self.bridge.size):
                self.bridge.send(("init", init), peer)
        self._push_weights(step - 1)

    def _push_weights(self, version: int) -> None:
        items = full_weights(self.trainer.c.actor_module)  # a collective over the training ranks
        if self.bridge is not None:
            self._weights_s = send_weights(self.bridge, items, version, int(self.settings.bucket_mb) << 20)
        self.version = version

    def _submit(self, step: int) -> None:
        from rlcore.distributed.init import gather_object

        t, c = self.trainer, self.trainer.c
        before = copy.deepcopy(self.filler.state_dict())
        rows = self.filler(c.train_loader.next_batch())
        prompts, extras = t.expand(rows)
        t.hook.rlcore_before_generation(step=step, prompts=prompts)
        self.pending[step] = (before, extras)
        everyone = gather_object(prompts, 0)
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
            for kind, got_step, *_ in got:
                if kind != "result" or got_step != step:
                    raise RuntimeError(f"plugin '{NAME}': expected the samples of step {step}, got {kind} {got_step}")
            version = min(g[2] for g in got)
            pad = int(self.trainer.c.tokenizer.pad_token_id)
            batch = concat_batches([g[3] for g in got if g[3].batch_size], pad)
            counts, parts, start = self.counts.pop(step), [], 0
            for n in counts:
                parts.append((_rows(batch, start, start + n), version))
                start += n
        rollout, version = scatter_object(parts, 0)
        return rollout, version


def _rows(batch: Any, a: int, b: int) -> Any:
    return dataclasses.replace(batch, prompt_ids=batch.prompt_ids[a:b], prompt_mask=batch.prompt_mask[a:b],
                               response_ids=batch.response_ids[a:b], response_mask=batch.response_mask[a:b],
                               logprobs=batch.logprobs[a:b], stats=dict(batch.stats))


def _engine_kwargs(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    engine = OmegaConf.to_container(cfg.actor.rollout_engine, resolve=True) or {}
    return dict(engine, max_batch_size=int(cfg.ppo.generation.batch_size),
                max_seq_len=int(cfg.data.max_prompt_length) + int(cfg.ppo.generation.max_new_tokens))


# ----------------------------------------------------------------------------------------------
# the rollout ranks' side
# ----------------------------------------------------------------------------------------------


class RolloutWorker:
    """A rollout rank: wait for the model, then generate whatever training rank 0 queues, taking new
    weights between two generation calls, until told to stop."""

    def __init__(self, config: Any, split: Any):
        self.config, self.split, self.bridge = config, split, split.bridge
        self.device = split.dist.device
        self.model: Optional[torch.nn.Module] = None
        self.backend: Any = None
        self.version = -1
        self.micro = 1

    def run(self) -> int:
        log.info("rollout rank %d of %d: waiting for the model", self.split.dist.rank, self.split.rollout_ranks)
        while True:
            msg = self.bridge.recv(0)
            kind = msg[0]
            if kind == "init":
                self._build(msg[1])
            elif kind == "weights":
                receive_weights(self.bridge, msg[2], self.model)
                self.version = int(msg[1])
                if self.backend is None:
                    self._make_backend()
                else:
                    self.backend.sync_weights()
            elif kind == "generate":
                self.bridge.send(("result", msg[1], self.version, self._generate(msg[2], msg[3])), 0)
            elif kind == "stop":
                return 0
            else:
                raise RuntimeError(f"plugin '{NAME}': rollout rank got an unknown message {kind!r}")

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
        from rlcore.rollout import make_backend

        kw = dict(self.init["engine"], device=self.device)
        self.backend = make_backend(self.model, self.init["backend"], **kw)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: Any) -> Any:
        from rlcore.rollout.base import concat_batches

        parts = []
        for i in range(0, len(prompts), self.micro):
            out = self.backend.generate(prompts[i:i + self.micro], params)
            parts.append(dataclasses.replace(out, prompt_ids=out.prompt_ids.cpu(), prompt_mask=out.prompt_mask.cpu(),
                                             response_ids=out.response_ids.cpu(),
                                             response_mask=out.response_mask.cpu(), logprobs=out.logprobs.cpu()))
        if not parts:
            from rlcore.rollout.base import RolloutBatch

            empty = torch.zeros(0, 0, dtype=torch.long)
            return RolloutBatch(empty, empty, empty, empty, torch.zeros(0, 0))
        return concat_batches(parts, int(params.pad_token_id))
