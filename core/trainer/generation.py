"""The actor's rollout, two calls deep from the loop: :meth:`ActorGeneration.generate` -> the backend.

Inside one call it switches the actor to the reshard policy's generation layout, asks the policy
which prompts this rank generates (:meth:`~rlcore.protocols.ReshardPolicy.generation_share`), takes
the rollout backend of the generation module (built there on first use; before a later rollout
refreshed with ``sync_weights`` only when the weights changed since its last refresh) and runs it
in micro-batches of ``ppo.generation.batch_size`` prompts, halving the micro-batch on
out-of-memory and retrying the failed chunk so no sample is lost.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from rlcore.contract import RolloutContract, check_own_rows, check_share
from rlcore.protocols import ReshardPolicy, RolloutBackend, RolloutRequest
from rlcore.rollout.base import (FinishedCallback, RolloutBatch, SamplingParams, concat_batches, reports_finished,
                                 takes_limits)

log = logging.getLogger(__name__)

#: ``make_backend(module, tensor_parallel) -> RolloutBackend``; ``tensor_parallel`` is True for a
#: generation module with DTensor weights (a tensor-parallel replica).
BackendFactory = Callable[[torch.nn.Module, bool], RolloutBackend]


def has_dtensor_params(module: torch.nn.Module) -> bool:
    """True when some parameter of ``module`` is a DTensor (a sharded or tensor-parallel layout)."""
    return any(type(p).__name__ == "DTensor" or hasattr(p, "device_mesh") for p in module.parameters())


def weights_signature(module: torch.nn.Module) -> Optional[tuple]:
    """Which tensors ``module``'s parameters are, where their data lie, and their in-place write
    counters; None where that cannot be read (the caller then assumes a change)."""
    try:
        out = []
        for p in module.parameters():
            local = getattr(p, "_local_tensor", p)  # a DTensor's shard on this rank
            out.append((id(p), local.data_ptr(), local._version))
        return tuple(out)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _shifted(on_finished: FinishedCallback, offset: int) -> FinishedCallback:
    """``on_finished`` of a chunk starting at ``offset``: its indices shifted to the whole call's."""
    return lambda indices, responses: on_finished([offset + i for i in indices], responses)


def release_kv(backend: RolloutBackend, plugin: Optional[str] = None) -> int:
    """Let ``backend`` hand its KV cache's memory back after a rollout (its optional ``release_kv()``,
    :meth:`rlcore.rollout.engine.RolloutEngine.release_kv`), so the update has it; the bytes freed. A
    backend takes the memory again when it next generates.

    :raises PluginError: naming ``plugin`` (the plugin that built the backend; default: its class) when the
        answer is not an int >= 0."""
    from rlcore.errors import PluginError

    release = getattr(backend, "release_kv", None)
    if not callable(release):
        return 0
    freed = release()
    if not isinstance(freed, int) or isinstance(freed, bool) or freed < 0:
        raise PluginError(f"plugin '{plugin or type(backend).__name__}': its rollout backend "
                          f"{type(backend).__name__}.release_kv() returned {freed!r}; expected the bytes freed, "
                          "an int >= 0")
    return freed


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class ActorGeneration:
    """Rollouts of ``actor`` through ``reshard``'s generation layout.

    :param actor: the actor as the reshard policy prepared it for training.
    :param reshard: the reshard policy.
    :param make_backend: builds the rollout backend of a generation module (see :data:`BackendFactory`).
    :param micro_batch: prompts per backend call (``ppo.generation.batch_size``); halves on out-of-memory.
    :param minimum: the smallest micro-batch; an out-of-memory error at it is raised.
    :param prebuilt: ``{id(module): backend}`` already built for the current weights (single process:
        the training module generates itself).
    :param contract: checks every backend call (:class:`rlcore.contract.RolloutContract`: prompts carrying
        episodes need a backend that plays them; each returned batch keeps the contract) and the reshard
        policy's share; None: unchecked.
    :param reshard_plugin: the plugin that built ``reshard`` (named by the share's checks).
    """

    def __init__(self, actor: torch.nn.Module, reshard: ReshardPolicy, make_backend: BackendFactory,
                 micro_batch: int, *, minimum: int = 1, prebuilt: Optional[dict[int, RolloutBackend]] = None,
                 contract: Optional[RolloutContract] = None, reshard_plugin: str = "reshard policy"):
        if micro_batch < 1 or minimum < 1:
            raise ValueError(f"ActorGeneration: micro_batch ({micro_batch}) and minimum ({minimum}) must be >= 1")
        self.actor, self.reshard, self.make_backend = actor, reshard, make_backend
        self.micro_batch, self.minimum, self.retries = int(micro_batch), int(minimum), 0
        self.contract, self.reshard_plugin = contract, reshard_plugin
        #: the backends built so far, by ``id`` of their generation module
        self.backends: dict[int, RolloutBackend] = dict(prebuilt or {})
        #: counts the changes of the actor's weights announced by :meth:`weights_changed`
        self.version = 0
        #: per backend, what its weights were read from: (:attr:`version`, :func:`weights_signature`)
        self._synced: dict[int, tuple[int, Optional[tuple]]] = {key: (0, weights_signature(actor))
                                                                  for key in self.backends}

    def weights_changed(self) -> None:
        """Say that the actor's weights changed (an optimizer step, a checkpoint loaded): every
        backend is refreshed before its next rollout."""
        self.version += 1

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Count every step of ``optimizer`` (the actor's) as a change of the weights."""
        optimizer.register_step_post_hook(lambda *_: self.weights_changed())

    def backend(self, module: torch.nn.Module) -> RolloutBackend:
        """The backend of ``module`` (call inside ``generation()``): built on first use, so an engine
        copies or references the gathered weights, never the shards. On a later use it is refreshed
        with ``sync_weights`` only when the weights changed since it last read them: a change
        announced by :meth:`weights_changed` (an optimizer step :meth:`follow` counts, a resume), or
        parameters of ``module`` that are other tensors, moved, or were written in place (a gathered
        layout that was released and gathered again)."""
        key = id(module)
        current = (self.version, weights_signature(module))
        if key not in self.backends:
            self.backends[key] = self.make_backend(module, has_dtensor_params(module))
        elif current[1] is None or self._synced.get(key) != current:
            self.backends[key].sync_weights()
        self._synced[key] = current
        return self.backends[key]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finished: Optional[FinishedCallback] = None, *, whole: bool = False,
                 max_new_tokens: Optional[Sequence[int]] = None) -> RolloutBatch:
        """One sample per prompt, rows in the order of ``prompts``.

        ``whole``: a backend with ``continuous_batching`` (the engine) gets every prompt in one call
        (it queues those beyond its slots, so the tail of one chunk never waits for the next); after an
        out-of-memory error, or with another backend, the prompts go in micro-batches as usual.

        ``on_finished`` (:data:`rlcore.rollout.base.FinishedCallback`) is handed to a backend that
        reports finished samples (:func:`rlcore.rollout.base.reports_finished`), with indices into
        ``prompts``, where this rank generates all of them; otherwise it is not called. A chunk
        retried after an out-of-memory error may report samples again.

        ``max_new_tokens``: each prompt's own token limit (at most ``params.max_new_tokens``), given to a
        backend whose ``generate`` takes it (the engine) where this rank generates every prompt; another
        backend decodes up to ``params.max_new_tokens`` and the caller cuts the responses."""
        with self.reshard.generation(self.actor) as module:
            module.eval()
            backend = self.backend(module)
            share = self.reshard.generation_share(prompts, params)
            if self.contract is not None:
                check_share(share, prompts, self.reshard_plugin)
            whole = len(share.prompts) == len(prompts)
            report = on_finished if on_finished is not None and whole and reports_finished(backend) else None
            one_call = len(share.prompts) if whole and getattr(backend, "continuous_batching", False) else None
            # per-prompt limits where this rank generates the prompts as given (a share in another order would
            # misplace them)
            limits = max_new_tokens if max_new_tokens is not None and takes_limits(backend) and (
                share.prompts is prompts or [list(p) for p in share.prompts] == [list(p) for p in prompts]) else None
            batch = self._in_micro_batches(backend, share.prompts, share.params, report, one_call, limits)
            released = release_kv(backend, self.contract.plugin(backend) if self.contract is not None else None)
            if released:
                batch.stats["rollout/kv_released_bytes"] = float(released)
        own = share.own(batch)
        if self.contract is not None:
            check_own_rows(own, prompts, self.reshard_plugin)
        return own

    def close(self) -> None:
        """Close every backend built (``close()`` where it has one)."""
        from rlcore.plugin_manager import close_answer

        for backend in self.backends.values():
            close_answer(backend)
        self.backends.clear()

    def _in_micro_batches(self, backend: RolloutBackend, prompts: Sequence[Sequence[int]],
                          params: SamplingParams, on_finished: Optional[FinishedCallback] = None,
                          first_chunk: Optional[int] = None, limits: Optional[Sequence[int]] = None) -> RolloutBatch:
        """``backend.generate`` chunk by chunk (the first chunk of ``first_chunk`` prompts when given, until
        an out-of-memory error). A seeded call gives each chunk its own seed (``seed + first prompt
        index``) so repeated prompts in different chunks do not share noise."""
        parts: list[RolloutBatch] = []
        start = 0
        while start < len(prompts):
            size = min(first_chunk or self.micro_batch, len(prompts) - start)
            chunk_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + start)
            kw = {} if on_finished is None else {"on_finished": _shifted(on_finished, start)}
            if limits is not None:
                kw["max_new_tokens"] = [min(int(n), chunk_params.max_new_tokens) for n in limits[start:start + size]]
            chunk = prompts[start:start + size]
            if self.contract is not None:
                self.contract.admit(backend, chunk)
            try:
                part = backend.generate(chunk, chunk_params, **kw)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_oom(error) or (first_chunk is None and self.micro_batch <= self.minimum):
                    raise
                self.retries += 1
                if first_chunk is not None:  # the one call did not fit: micro-batches from here
                    first_chunk = None
                    log.warning("rollout out of memory with %d prompts in one call; retrying in micro-batches of %d",
                                size, self.micro_batch)
                else:
                    self.micro_batch = max(self.minimum, self.micro_batch // 2)
                    log.warning("rollout out of memory at micro-batch %d; retrying at %d", size, self.micro_batch)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            if self.contract is not None:
                self.contract.check(backend, part, chunk, chunk_params.max_new_tokens)
            parts.append(part)
            start += size
            first_chunk = None
        return concat_batches(parts, params.pad_token_id)


def rollout_request(actor_cfg: Any, data_cfg: Any, ppo: Any) -> RolloutRequest:
    """What the actor's rollout asks of ``rlcore_rollout_backend`` (``actor``, ``data`` and ``ppo`` sections).

    With partial rollouts (``ppo.partial_rollout.segment`` below ``max_new_tokens``) a carried sample's
    prompt holds its response so far and its segment may reach past the response cap before it is cut
    there (:mod:`rlcore.trainer.partial`), so the longest sequence grows by one segment."""
    max_new = int(ppo.generation.max_new_tokens)
    partial = getattr(ppo, "partial_rollout", None)
    segment = int(partial.segment) if partial is not None else 0
    longest = data_cfg.max_prompt_length + max_new + (segment if 0 < segment < max_new else 0)
    return RolloutRequest(backend=actor_cfg.rollout_backend, max_batch_size=int(ppo.generation.batch_size),
                          max_seq_len=longest,
                          engine=actor_cfg.rollout_engine.engine_kwargs(), episodes=bool(data_cfg.env_key))

