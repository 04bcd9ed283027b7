"""The state of a checkpoint: what each entry is, writing it (at once or in the background), loading it back.

Loading reads data only: every file goes through ``torch.load(weights_only=True)``, and DCP's
``.metadata`` (which DCP unpickles) is first read with an unpickler that admits only DCP's metadata
types, so a crafted checkpoint cannot run code (see "Trust boundary" in docs/checkpoints.md). What a component saves in
its ``state_dict`` must therefore be plain containers (dict, list, tuple), numbers, strings, None
and tensors; :data:`SAFE_TYPES` lists the few other types allowed.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
import random
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from rlcore.distributed.init import dist_active
from rlcore.errors import CheckpointError
from rlcore.protocols import DistInfo
from rlcore.trainer.store import files

log = logging.getLogger(__name__)

OPTIM_SUFFIXES = ("_optim", "_optimizer", "_opt")
RESHARD_NOTE = ("the ranks deal out the rest of the epoch's prompts between them (none taken twice, none "
                "skipped), but per-rank random streams cannot be split across a different number of "
                "processes: ranks the saved run did not have start from fresh seeds, so training continues "
                "correctly but does not repeat the uninterrupted run sample for sample")


# --------------------------------------------------------------------------------------------
# Random streams
# --------------------------------------------------------------------------------------------


class RNGState:
    """Random streams of this process: python, numpy, torch CPU, every CUDA device, and named generators.

    The checkpoint policy saves one copy per rank. Extra ``torch.Generator`` objects (e.g. the one
    shuffling mini-batches) join with :meth:`register` so a resumed run draws the same numbers.
    """

    def __init__(self, generators: Optional[Mapping[str, torch.Generator]] = None):
        self.generators: dict[str, torch.Generator] = dict(generators or {})

    def register(self, name: str, generator: torch.Generator) -> torch.Generator:
        self.generators[name] = generator
        return generator

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "torch": torch.get_rng_state(),
            "generators": {n: g.get_state() for n, g in self.generators.items()},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import numpy as np

        random.setstate(_as_tuple(state["python"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
        torch.set_rng_state(state["torch"])
        for name, gen_state in state.get("generators", {}).items():
            if name in self.generators:
                self.generators[name].set_state(gen_state)
            else:
                log.warning("checkpoint holds RNG generator %r that this run does not register; ignored", name)
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                log.warning("checkpoint holds CUDA RNG states of %d devices, this process sees %d: "
                            "CUDA random streams restart from the seed", len(cuda), torch.cuda.device_count())


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# --------------------------------------------------------------------------------------------
# What each entry of the state is
# --------------------------------------------------------------------------------------------


def is_sharded(module: Any) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2 / tensor parallel)."""
    if not isinstance(module, torch.nn.Module):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def any_sharded(state: Mapping[str, Any]) -> bool:
    return any(is_sharded(v) for v in state.values())


def module_of(key: str, state: Mapping[str, Any]) -> Optional[torch.nn.Module]:
    """The module an optimizer key belongs to: ``actor_optim`` -> ``state["actor"]``."""
    for suffix in OPTIM_SUFFIXES:
        if key.endswith(suffix) and isinstance(state.get(key[: -len(suffix)]), torch.nn.Module):
            return state[key[: -len(suffix)]]
    return None


def kind_of(key: str, value: Any, state: Mapping[str, Any]) -> str:
    """``model`` | ``optim`` (tensor state, resharded by DCP) | ``rng`` | ``state`` (small, per rank)."""
    if isinstance(value, torch.nn.Module):
        return "model"
    if isinstance(value, torch.optim.Optimizer) and module_of(key, state) is not None:
        return "optim"
    if isinstance(value, RNGState):
        return "rng"
    return "state"


def _tensor_state(key: str, value: Any, state: Mapping[str, Any], *, full: bool = False) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if isinstance(value, torch.nn.Module):
        # a model with frozen weights (a LoRA actor) saves only what trains; the rest comes from its model path
        opts = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=has_frozen(value))
        return get_model_state_dict(value, options=opts)
    opts = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return get_optimizer_state_dict(module_of(key, state), value, options=opts)


def _saved_tensor_state(key: str, value: Any, state: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """What :func:`write_state` writes for ``state[key]``. An optimizer that has not stepped yet (a run whose
    first steps trained nothing: partial rollouts, dynamic sampling) is saved without state in the ``torch``
    format and left without it: reading its state dict through DCP initialises it with a zero-gradient step
    (Adam's step count becomes 1), so a run that saved before its first optimizer step would train otherwise
    than one that did not, and than the run resumed from it (:func:`_apply_tensor_state` clears it again)."""
    unstepped = fmt == "torch" and isinstance(value, torch.optim.Optimizer) and not value.state
    sd = _tensor_state(key, value, state)
    if unstepped:
        value.state.clear()
        sd = {**sd, "state": {}}
    return sd


def has_frozen(module: torch.nn.Module) -> bool:
    """Whether some parameter of ``module`` does not train (``requires_grad`` off)."""
    return any(not p.requires_grad for p in module.parameters())


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group (expected with one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class PendingSave:
    """A save whose data is still being written in the background."""

    def __init__(self, work: Callable[[], None]):
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="rlcore-checkpoint", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self._error = e

    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"asynchronous checkpoint save failed: {self._error}") from self._error


def stage(src: Any, buffers: Any = None) -> Any:
    """A CPU copy of the tree ``src``, written into the tensors of ``buffers`` (an earlier copy) where
    their shape and dtype match: reusing buffers spares the page faults of fresh allocations, which
    dominate the copy of a large state."""
    if isinstance(src, torch.Tensor):
        src = src.detach()
        if isinstance(buffers, torch.Tensor) and buffers.shape == src.shape and buffers.dtype == src.dtype:
            return buffers.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(src, dict):
        old = buffers if isinstance(buffers, dict) else {}
        return {k: stage(v, old.get(k)) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        old = buffers if isinstance(buffers, (list, tuple)) and len(buffers) == len(src) else [None] * len(src)
        return type(src)(stage(v, b) for v, b in zip(src, old))
    return copy.deepcopy(src)


class Staging:
    """The CPU copy of the last asynchronous save, kept to be overwritten by the next one."""

    def __init__(self) -> None:
        self.tree: Any = None

    def __call__(self, src: Any) -> Any:
        self.tree = stage(src, self.tree)
        return self.tree


def write_state(tmp: Path, state: Mapping[str, Any], fmt: str, dist: DistInfo, *, asynchronous: bool,
                on_done: Callable[[], None], process_group: Any = None,
                staging: Optional[Staging] = None) -> Optional[PendingSave]:
    """Write every entry of ``state`` under ``tmp``.

    Small state goes to ``state/rank_NNNNN.pt`` at once; models and optimizers go to ``<key>.pt``
    (``fmt="torch"``) or to DCP shards under ``dcp/``. With ``asynchronous`` the tensors are copied
    to CPU memory first and written by a background thread, which calls ``on_done`` on success;
    otherwise this returns None and the caller finalizes. ``process_group`` (gloo) carries the
    coordination of an asynchronous DCP save; ``staging`` keeps the CPU copy of a "torch" format
    asynchronous save for reuse (the caller waits for the previous save before the next one).
    """
    small = {k: v.state_dict() for k, v in state.items() if kind_of(k, v, state) in ("state", "rng")}
    files.save_file(small, tmp / "state" / f"rank_{dist.rank:05d}.pt")
    tensor_keys = [k for k, v in state.items() if kind_of(k, v, state) in ("model", "optim")]
    tensors = {k: _saved_tensor_state(k, state[k], state, fmt) for k in tensor_keys}
    if fmt == "torch":
        if not asynchronous:
            for k, sd in tensors.items():
                files.save_file(sd, tmp / f"{k}.pt")
            return None
        snapshot = (staging or Staging())(tensors)

        def work() -> None:
            for k, sd in snapshot.items():
                files.save_file(sd, tmp / f"{k}.pt")
            on_done()

        return PendingSave(work)
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(tmp / "dcp"), sync_files=True)
    with _dcp_quiet():
        if not asynchronous:
            dcp.save(tensors, storage_writer=writer, no_dist=not dist_active())
            return None
        response = dcp.async_save(tensors, storage_writer=writer, process_group=process_group,
                                  no_dist=not dist_active())
    future = getattr(response, "upload_completion", response)

    def wait_then_finish() -> None:
        future.result()
        on_done()

    return PendingSave(wait_then_finish)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


#: Types other than containers, numbers, strings and tensors that a checkpoint may hold.
SAFE_TYPES: tuple[type, ...] = ()


def load_file(path: Path) -> Any:
    """The data in ``path``, read with ``torch.load(weights_only=True)``: no code runs.

    :raises CheckpointError: the file cannot be read, or holds objects other than data.
    """
    try:
        with torch.serialization.safe_globals(list(SAFE_TYPES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling problem is a checkpoint problem
        text = str(e)
        if "weights_only" in text or "Unsupported global" in text or "unsupported" in text.lower():
            first = next((ln.strip() for ln in text.splitlines() if "GLOBAL" in ln or "global" in ln), "")
            raise CheckpointError(f"{path} holds objects other than data and was not loaded: checkpoints are "
                                  f"read as data only, never as code ({first or type(e).__name__})") from e
        raise CheckpointError(f"cannot load {path}: {text.splitlines()[0] if text else type(e).__name__}") from e


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` (which DCP itself reads with plain ``pickle.load``) allowing only
    the types such metadata is made of: DCP's metadata classes, tensor sizes and dtypes, paths."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and isinstance(obj, type))
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch" and (name == "Size" or isinstance(obj, torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")
        return obj


def check_dcp_metadata(path: Path) -> None:
    """Read the ``.metadata`` of the DCP directory ``path`` as data before DCP unpickles it.

    :raises CheckpointError: it holds anything but DCP metadata (it would run code when loaded).
    """
    try:
        with open(path / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, AttributeError, ImportError) as e:
        raise CheckpointError(f"{path / '.metadata'} holds objects other than data and was not loaded: "
                              f"checkpoints are read as data only, never as code ({e})") from e
    except (OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / '.metadata'}: {e}") from e


def _apply_tensor_state(key: str, value: Any, sd: dict[str, Any], state: Mapping[str, Any], full: bool) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    try:
        if isinstance(value, torch.nn.Module):
            frozen = has_frozen(value)
            opts = StateDictOptions(full_state_dict=full, strict=not frozen, ignore_frozen_params=frozen)
            result = set_model_state_dict(value, sd, options=opts)
            trainable = {n for n, p in value.named_parameters() if p.requires_grad}
            missing = sorted(k for k in getattr(result, "missing_keys", []) if k in trainable)
            if frozen and missing:
                raise KeyError(f"the checkpoint lacks trainable weights {missing[:5]}"
                               + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        else:
            opts = StateDictOptions(full_state_dict=full, strict=True)
            set_optimizer_state_dict(module_of(key, state), value, sd, options=opts)
            if full and not sd.get("state"):  # saved before its first step: DCP's initialising step is undone
                value.state.clear()
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint entry {key!r} does not fit this run's {type(value).__name__}: {e}") from e


def load_state(path: Path, manifest: Mapping[str, Any], state: Mapping[str, Any], dist: DistInfo, *,
               seed: int) -> None:
    """Load checkpoint ``path`` into ``state`` (models, optimizers, then small state, RNG last)."""
    kinds = manifest["kinds"]
    tensor_keys = [k for k in state if kinds.get(k) in ("model", "optim")]
    if manifest["format"] == "torch":
        for k in tensor_keys:
            sd = load_file(path / f"{k}.pt")
            _apply_tensor_state(k, state[k], sd, state, full=True)
    else:
        import torch.distributed.checkpoint as dcp

        template = {k: _tensor_state(k, state[k], state) for k in tensor_keys}
        check_dcp_metadata(path / "dcp")
        reader = dcp.FileSystemReader(str(path / "dcp"))
        try:
            with _dcp_quiet():
                dcp.load(template, storage_reader=reader, no_dist=not dist_active())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot load sharded state from {path / 'dcp'}: {e}") from e
        for k in tensor_keys:
            _apply_tensor_state(k, state[k], template[k], state, full=False)
    saved_ws = int(manifest["world_size"])
    src = dist.rank if dist.rank < saved_ws else 0
    small = load_file(path / "state" / f"rank_{src:05d}.pt")
    rng_keys = [k for k in state if kinds.get(k) == "rng"]
    for k in [k for k in state if kinds.get(k) == "state"] + rng_keys:
        if k in rng_keys and src != dist.rank:
            reseed(seed * 1000003 + int(manifest["step"]) * 101 + dist.rank)
            continue
        try:
            state[k].load_state_dict(small[k])
        except Exception as e:  # noqa: BLE001 - a component's own check
            raise CheckpointError(f"checkpoint {path}: state of {k!r} cannot be restored: {e}") from e


def reseed(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


