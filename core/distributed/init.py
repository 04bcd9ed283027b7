"""Process-group lifecycle: start (under ``torchrun``), stop, and the few collectives the loop needs.

A run started by ``torchrun`` (or by :func:`rlcore.distributed.launch.maybe_launch`) finds
``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` in its environment; :func:`init_distributed` then joins
the process group (NCCL on CUDA, gloo on CPU) and pins this process to its local GPU. Without them
the run is a single process and every helper here is a cheap no-op.

Failure handling: every collective has a timeout (``RLCORE_DIST_TIMEOUT_S``, default 600 s), and a
rank that raises writes its traceback to torchrun's error file, so the launcher stops the other
ranks and names the failing one (see ``docs/distributed.md``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Mapping

import torch
import torch.distributed as tdist

from rlcore.distributed.env import DEFAULT_TIMEOUT_S, ENV_TIMEOUT, collective_timeout, env_int  # noqa: F401 - also read here
from rlcore.errors import PlacementError
from rlcore.protocols import DistInfo

log = logging.getLogger(__name__)

DEVICE_PREFS = ("auto", "cpu", "cuda")


def known_world_size(nproc_per_node: int | None) -> int | None:
    """The number of processes of a run when known before any starts (torchrun's ``WORLD_SIZE``, or
    ``trainer.nproc_per_node`` > 1); None for a plain command, which a launcher may still start."""
    world = env_int("WORLD_SIZE", 0)
    if world > 0:
        return world
    return int(nproc_per_node) if int(nproc_per_node or 1) > 1 else None


def check_device_pref(device_pref: str) -> str:
    """``trainer.device``'s kind (``auto``, ``cpu`` or ``cuda``), checked against this machine:
    a :class:`PlacementError` names the key for an unknown kind or CUDA without a GPU."""
    pref = (device_pref or "auto").split(":")[0]
    if pref not in DEVICE_PREFS:
        raise PlacementError(f"trainer.device = {device_pref!r}: use one of {', '.join(DEVICE_PREFS)}")
    if pref == "cuda" and not torch.cuda.is_available():
        raise PlacementError(f"trainer.device = {device_pref!r} but no CUDA GPU is available")
    return pref


def _pick_device(device_pref: str, local_rank: int, distributed: bool) -> torch.device:
    pref = check_device_pref(device_pref)
    if pref == "cpu" or (pref == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not distributed:
        index = int(device_pref.split(":")[1]) if ":" in device_pref else torch.cuda.current_device()
        return torch.device("cuda", index)
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise PlacementError(f"LOCAL_RANK {local_rank} has no GPU: this node has {count} "
                             f"(start at most {count} processes per node, e.g. torchrun --nproc_per_node={count})")
    return torch.device("cuda", local_rank)


def _install_error_file_hook() -> None:
    """Write an uncaught exception to torchrun's error file (``TORCHELASTIC_ERROR_FILE``), so the
    launcher's summary names this rank as the root cause and shows its traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    previous = sys.excepthook

    def hook(etype, value, tb):  # pragma: no cover - runs in a dying worker
        if etype.__name__ != "SignalException":  # stopped by the launcher: not a root cause
            try:
                write_error_file(path, value, "".join(traceback.format_exception(etype, value, tb)))
            except OSError:
                pass
        previous(etype, value, tb)

    sys.excepthook = hook


def write_error_file(path: str, error: BaseException, callstack: str) -> None:
    """The JSON record torch elastic reads back from a failed worker."""
    record = {"message": {"message": f"{type(error).__name__}: {error}",
                          "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(record, f)


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def quiet_other_ranks(rank: int) -> None:
    """On ranks other than 0, keep warnings and errors but drop INFO lines (rank 0 says them once
    for the job), unless the log level is DEBUG."""
    root = logging.getLogger()
    if rank == 0 or root.getEffectiveLevel() <= logging.DEBUG:
        return
    for handler in root.handlers:
        if not any(isinstance(f, _WarningsOnly) for f in handler.filters):
            handler.addFilter(_WarningsOnly())


def init_distributed(device_pref: str = "auto") -> DistInfo:
    """Join the process group when started by torchrun (``WORLD_SIZE`` > 1); else describe one process.

    :param device_pref: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
    :returns: this process's :class:`~rlcore.protocols.DistInfo`.
    :raises PlacementError: a device that does not exist, or more local ranks than GPUs.
    """
    world = env_int("WORLD_SIZE", 1)
    if world <= 1:
        return DistInfo(device=_pick_device(device_pref, 0, distributed=False))
    local_rank = env_int("LOCAL_RANK", 0)
    device = _pick_device(device_pref, local_rank, distributed=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": collective_timeout()}
        if device.type == "cuda":
            kwargs["device_id"] = device
        tdist.init_process_group(**kwargs)
    _install_error_file_hook()
    info = DistInfo(rank=tdist.get_rank(), world_size=tdist.get_world_size(), local_rank=local_rank, device=device)
    quiet_other_ranks(info.rank)
    if info.is_main:
        log.info("process group: %d ranks, backend %s, timeout %.0f s", info.world_size,
                 tdist.get_backend(), collective_timeout().total_seconds())
    return info


def init_split(device_pref: str, rollout_ranks: int, weights_backend: str = "auto") -> Any:
    """Join a job split into training and rollout groups (``rlcore_world_split``): this process's
    :class:`~rlcore.distributed.split.SplitInfo`. Its ``dist`` describes the process's own group, and
    every helper of this module works inside that group."""
    from rlcore.distributed.split import split_world

    local_rank = env_int("LOCAL_RANK", 0)
    device = _pick_device(device_pref, local_rank, distributed=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = split_world(rollout_ranks, device, weights_backend)
    _install_error_file_hook()
    quiet_other_ranks(info.global_rank)
    return info


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def dist_active() -> bool:
    """Whether this process is one of several in an initialised process group."""
    return is_initialized() and tdist.get_world_size() > 1


def is_main_process() -> bool:
    """Rank 0 of an initialised process group, or a single process."""
    return not is_initialized() or tdist.get_rank() == 0


def destroy() -> None:
    """Leave the process group (no-op in a single process)."""
    if is_initialized():
        tdist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist_active():
        tdist.barrier()


def collective_device() -> torch.device:
    """The device small collectives use: CUDA under a NCCL-only process group, else CPU (gloo)."""
    if not is_initialized():
        return torch.device("cpu")
    backend = str(tdist.get_backend()).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_gloo_group() -> Any:
    """A gloo group for background work (e.g. asynchronous checkpoint writes), so it never shares a
    NCCL stream with training (collective; None in a single process)."""
    if not dist_active():
        return None
    return tdist.new_group(backend="gloo")


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (collective; ``flag`` in a single process)."""
    if not dist_active():
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item() > 0)


def all_reduce_mean(metrics: Mapping[str, float]) -> dict[str, float]:
    """Average a flat ``name -> number`` mapping over ranks; a name missing on some rank averages the others.

    Every rank must call it; the result is the same on every rank.
    """
    if not is_initialized() or tdist.get_world_size() == 1:
        return {k: float(v) for k, v in metrics.items()}
    names: list[list[str]] = [None] * tdist.get_world_size()  # type: ignore[list-item]
    tdist.all_gather_object(names, sorted(metrics))
    keys = sorted(set().union(*names))
    dev = collective_device()
    values = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64, device=dev)
    counts = torch.tensor([1.0 if k in metrics else 0.0 for k in keys], dtype=torch.float64, device=dev)
    both = torch.stack([values, counts])
    tdist.all_reduce(both)
    mean = both[0] / both[1].clamp(min=1.0)
    return {k: float(v) for k, v in zip(keys, mean.tolist())}


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects only); returns ``obj`` in a single process."""
    if not is_initialized() or tdist.get_world_size() == 1:
        return obj
    box = [obj if tdist.get_rank() == src else None]
    tdist.broadcast_object_list(box, src=src, device=collective_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in a single process)."""
    if not is_initialized() or tdist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def gather_object(obj: Any, dst: int) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank ``dst``; ``None`` on the others (``[obj]`` in a
    single process). Each object travels once, to ``dst`` only."""
    if not is_initialized() or tdist.get_world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * tdist.get_world_size() if tdist.get_rank() == dst else None
    tdist.gather_object(obj, out, dst=dst)
    return out


def scatter_object(objs: list[Any] | None, src: int) -> Any:
    """Rank ``src``'s ``objs[r]`` on each rank ``r`` (``objs`` is read on ``src`` only; ``objs[0]``
    in a single process)."""
    if not is_initialized() or tdist.get_world_size() == 1:
        return objs[0]
    box: list[Any] = [None]
    tdist.scatter_object_list(box, objs if tdist.get_rank() == src else None, src=src)
    return box[0]
