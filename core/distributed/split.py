"""Splitting one ``torchrun`` job into a training group and a rollout group, joined by a bridge.

Some plugins (``async``) run generation and training on different ranks. They answer
``rlcore_world_split`` with a number of rollout ranks ``R``; the last ``R`` ranks of the job then
generate and the first ``T = W - R`` train. :func:`split_world` is called instead of the usual
process-group start, before anything else uses ``torch.distributed``:

* the training ranks form the default process group on their own (ranks ``0 .. T-1``, the same
  backend as an ordinary run), so FSDP, checkpoints, metrics and every collective of the trainer work
  unchanged and see a world of ``T`` ranks (``RANK`` and ``WORLD_SIZE`` in the environment are set
  to those values too);
* the rollout ranks form a default group of their own (ranks ``0 .. R-1``);
* a *bridge* — a gloo group of training rank 0 (bridge rank 0) and every rollout rank (bridge ranks
  ``1 .. R``) — carries requests, samples and weights between the two groups (:class:`Bridge`); on
  GPUs the weights take an NCCL group of the same members instead.

All three groups are built from the launcher's rendezvous store under distinct prefixes, so no
process joins a group it does not belong to. Collectives and the bridge's operations have the
job's collective timeout (``RLCORE_DIST_TIMEOUT_S``), and a rank that dies closes its connections:
its peers fail with an error naming it instead of waiting forever. (A rollout rank's wait for its
next request has no limit: the trainers may take as long as they need between two requests.)
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as tdist

from rlcore.distributed.env import ENV_TIMEOUT, collective_timeout, env_int
from rlcore.errors import PlacementError
from rlcore.protocols import DistInfo

#: ``timeout`` of :meth:`Bridge.send` and :meth:`Bridge.recv` when not given: the bridge's own
_BRIDGE_TIMEOUT: Any = object()

log = logging.getLogger(__name__)


class BridgeError(RuntimeError):
    """A peer across the bridge did not answer (it died, or timed out)."""


class Bridge:
    """Point-to-point objects and broadcast tensors between training rank 0 and the rollout ranks.

    ``group`` is a gloo process group of ``1 + R`` members (bridge rank 0 is training rank 0). Objects
    travel pickled as byte tensors (a length, then the bytes) under two tags of their sender's own
    (``2 * sender`` and ``2 * sender + 1``), so one thread may send while another receives on the same
    pair; tensors are broadcast in place.

    A gloo send completes only once its receiver has posted the matching receive: a protocol over
    the bridge must never have two members sending to each other with neither receiving.

    :param timeout: how long an operation may wait for its peer before the peer counts as lost
        (``None``: as long as it takes; a peer that dies still fails it at once).
    :param weights_group: an NCCL group of the same members for :meth:`broadcast` (GPU jobs), whose
        tensors then live on ``weights_device``; ``None``: broadcast over ``group``, on the CPU.
    """

    def __init__(self, group: Any, rank: int, size: int, names: Sequence[str], timeout: Optional[timedelta] = None,
                 weights_group: Any = None, weights_device: Optional[torch.device] = None):
        self.group, self.rank, self.size = group, rank, size
        self.names = list(names)  # who each bridge rank is, for error messages
        self.timeout = timeout
        self.weights_group = weights_group
        #: where :meth:`broadcast`'s tensors must be
        self.weights_device = weights_device if weights_group is not None else torch.device("cpu")

    def _run(self, op: Any, what: str, peer: Optional[int], timeout: Optional[timedelta]) -> None:
        """Start ``op()`` (a gloo operation) and wait for it; any failure is a :class:`BridgeError` naming the peer."""
        try:
            work = op()
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        except Exception as error:  # gloo raises RuntimeError on timeouts and closed connections
            who = self.names[peer] if peer is not None else "the bridge"
            limit = f" (bridge timeout {timeout.total_seconds():.0f} s, {ENV_TIMEOUT})" if timeout is not None else ""
            raise BridgeError(f"{what} {who} failed{limit}: {error}. The rank may have died (its own error is in "
                              "the launcher's summary) or stopped answering") from error

    def send(self, obj: Any, dst: int, timeout: Any = _BRIDGE_TIMEOUT) -> None:
        timeout = self.timeout if timeout is _BRIDGE_TIMEOUT else timeout
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._run(lambda: self.group.send([size], dst, 2 * self.rank), "sending to", dst, timeout)
        self._run(lambda: self.group.send([data], dst, 2 * self.rank + 1), "sending to", dst, timeout)

    def recv(self, src: int, timeout: Any = _BRIDGE_TIMEOUT) -> Any:
        """The next object from bridge rank ``src``; ``timeout`` ``None`` waits as long as it takes."""
        timeout = self.timeout if timeout is _BRIDGE_TIMEOUT else timeout
        size = torch.zeros(1, dtype=torch.int64)
        self._run(lambda: self.group.recv([size], src, 2 * src), "waiting for", src, timeout)
        data = torch.empty(int(size), dtype=torch.uint8)
        self._run(lambda: self.group.recv([data], src, 2 * src + 1), "waiting for", src, timeout)
        return pickle.loads(data.numpy().tobytes())

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Bridge rank ``src``'s ``tensors`` into every member's (same shapes and dtypes, on
        :attr:`weights_device`): a collective every member enters, in the same order. The tensors are
        ready when it returns (an NCCL broadcast is waited for on the host)."""
        opts = tdist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        group = self.weights_group if self.weights_group is not None else self.group
        for t in tensors:
            self._run(lambda: group.broadcast([t], opts), "broadcasting weights over", None, self.timeout)
        if self.weights_device.type == "cuda":
            torch.cuda.current_stream(self.weights_device).synchronize()


@dataclass
class SplitInfo:
    """This process's place in a split job."""

    role: str  # "train" or "rollout"
    dist: DistInfo  # rank and world size inside this process's own group
    global_rank: int
    world_size: int  # the whole job
    rollout_ranks: int
    bridge: Optional[Bridge]  # None on training ranks other than 0

    @property
    def bridge_rank(self) -> int:
        return 0 if self.role == "train" else 1 + self.dist.rank

    def close(self) -> None:
        """Leave the groups once this process's part is done (the bridge first, then its own group),
        so that no group's threads are still running while the interpreter shuts down."""
        self.bridge = None
        if tdist.is_initialized():
            tdist.destroy_process_group()


def _store(rank: int, world: int) -> Any:
    store, _, _ = next(tdist.rendezvous("env://", rank, world, timeout=collective_timeout()))
    return store


def _nccl_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """An NCCL process group of the bridge's members, outside the default group (for the weights)."""
    options = tdist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return tdist.ProcessGroupNCCL(tdist.PrefixStore("rlcore/bridge-nccl/", store), rank, size, options)


def split_world(rollout_ranks: int, device: torch.device, weights_backend: str = "auto") -> SplitInfo:
    """Build the training group, the rollout group and the bridge (see the module docstring).

    :param rollout_ranks: how many of the job's last ranks generate (at least 1, fewer than the job).
    :param device: this process's device (its local GPU, or the CPU).
    :param weights_backend: what the bridge broadcasts weights over: ``gloo`` (through the host),
        ``nccl`` (GPU to GPU) or ``auto`` (``nccl`` on GPUs).
    :raises PlacementError: the split leaves no training rank, or no rollout rank; ``nccl`` without GPUs.
    """
    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    if not 1 <= rollout_ranks < world:
        raise PlacementError(f"{rollout_ranks} rollout rank(s) out of a job of {world}: the rollout group needs at "
                             "least one rank and the training group at least one (start more processes)")
    if weights_backend not in ("auto", "gloo", "nccl"):
        raise PlacementError(f"weights backend {weights_backend!r}: use auto, gloo or nccl")
    if weights_backend == "nccl" and device.type != "cuda":
        raise PlacementError(f"weights over nccl need GPUs; this job runs on {device.type} (use gloo)")
    nccl = device.type == "cuda" and weights_backend != "gloo"
    train = world - rollout_ranks
    store = _store(rank, world)
    role = "train" if rank < train else "rollout"
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    group_rank, group_size = (rank, train) if role == "train" else (rank - train, rollout_ranks)
    timeout = collective_timeout()
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    tdist.init_process_group(backend, store=tdist.PrefixStore(f"rlcore/{role}/", store), rank=group_rank,
                             world_size=group_size, timeout=timeout, **kwargs)
    # code that reads the launcher's variables sees its own group
    os.environ.update(RANK=str(group_rank), WORLD_SIZE=str(group_size),
                      LOCAL_WORLD_SIZE=str(min(local_world, group_size)))
    bridge = None
    if role == "rollout" or group_rank == 0:
        bridge_rank = 0 if role == "train" else 1 + group_rank
        pg = tdist.ProcessGroupGloo(tdist.PrefixStore("rlcore/bridge/", store), bridge_rank, rollout_ranks + 1,
                                    timeout)
        names = ["training rank 0"] + [f"rollout rank {i} (job rank {train + i})" for i in range(rollout_ranks)]
        weights = _nccl_group(store, bridge_rank, rollout_ranks + 1, timeout) if nccl else None
        bridge = Bridge(pg, bridge_rank, rollout_ranks + 1, names, timeout, weights, device)
    info = DistInfo(rank=group_rank, world_size=group_size, local_rank=env_int("LOCAL_RANK", 0), device=device)
    if rank == 0:
        log.info("job split: %d training rank(s), %d rollout rank(s), bridge over gloo (weights over %s), timeout "
                 "%.0f s", train, rollout_ranks, "nccl" if nccl else "gloo", timeout.total_seconds())
    return SplitInfo(role=role, dist=info, global_rank=rank, world_size=world, rollout_ranks=rollout_ranks,
                     bridge=bridge)
