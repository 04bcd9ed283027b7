"""Reading and writing checkpoint directories: files, fsync, manifest with checksums, DCP shards.

:mod:`rlcore.trainer.checkpoint` decides *when* and *which*; this module only moves bytes. Every
function that touches ``torch.distributed`` works the same with one process and no process group.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from rlcore.errors import CheckpointError
from rlcore.protocols import DistInfo

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
OPTIM_SUFFIXES = ("_optim", "_optimizer", "_opt")
RESHARD_NOTE = ("per-rank data positions and RNG streams cannot be split across a different number of "
                "processes: ranks the saved run did not have start from rank 0's data position and fresh "
                "seeds, so training continues correctly but does not repeat the uninterrupted run sample "
                "for sample")


# --------------------------------------------------------------------------------------------
# torch.distributed utilities (no-ops in a single process)
# --------------------------------------------------------------------------------------------


def _dist_active() -> bool:
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def collective_device() -> torch.device:
    """The device small collectives use: CUDA under a NCCL-only process group, else CPU."""
    import torch.distributed as tdist

    backend = str(tdist.get_backend()).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if _dist_active():
        import torch.distributed as tdist

        tdist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _dist_active():
        return obj
    import torch.distributed as tdist

    box = [obj]
    tdist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group (expected with one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def new_gloo_group() -> Any:
    """A gloo group for DCP's background writes, so they never share a NCCL stream with training (collective)."""
    if not _dist_active():
        return None
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo")


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
    from rlcore.trainer.checkpoint import RNGState

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


def has_frozen(module: torch.nn.Module) -> bool:
    """Whether some parameter of ``module`` does not train (``requires_grad`` off)."""
    return any(not p.requires_grad for p in module.parameters())


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (bottom-up)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def save_file(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def remove_tree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older ``final``) and make the rename durable."""
    fsync_tree(tmp)
    trash = final.parent / f".trash-{final.name}"
    if final.exists():
        remove_tree(trash)
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_path(final.parent)
    remove_tree(trash)


def write_pointer(path: Path, target: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(target + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_pointer(path: Path) -> Optional[str]:
    try:
        name = path.read_text().strip()
    except OSError:
        return None
    return name or None


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


def sha256_of(path: Path, chunk: int = 8 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_all(root: Path, files: list[Path]) -> dict[str, str]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        digests = list(pool.map(sha256_of, files))
    return {str(p.relative_to(root)): d for p, d in zip(files, digests)}


def write_manifest(root: Path, *, step: int, world_size: int, fmt: str, kinds: Mapping[str, str]) -> None:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _hash_all(root, files)
    from rlcore import __version__

    manifest = {
        "format_version": FORMAT_VERSION, "step": int(step), "world_size": int(world_size), "format": fmt,
        "kinds": dict(kinds), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rlcore_version": __version__,
        "torch_version": torch.__version__,
        "files": {rel: {"bytes": (root / rel).stat().st_size, "sha256": d} for rel, d in digests.items()},
    }
    with open(root / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        with open(path / MANIFEST) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {e}") from e


def verify(path: Path) -> list[str]:
    """Problems that make checkpoint ``path`` unusable (empty list: complete and intact)."""
    if not path.is_dir():
        return [f"{path} does not exist"]
    if not (path / MANIFEST).is_file():
        return [f"no {MANIFEST} (the save did not finish)"]
    try:
        manifest = read_manifest(path)
        files = dict(manifest["files"])
        for key in ("step", "world_size", "format", "kinds"):
            manifest[key]
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        return [f"{MANIFEST} is unreadable or incomplete: {e}"]
    problems, present = [], []
    for rel, meta in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif p.stat().st_size != int(meta["bytes"]):
            problems.append(f"{rel} is truncated or altered: {p.stat().st_size} bytes, expected {meta['bytes']}")
        else:
            present.append(p)
    if problems:
        return problems
    digests = _hash_all(path, present)
    return [f"{rel} fails its sha256 check" for rel, d in sorted(digests.items()) if d != files[rel]["sha256"]]


# --------------------------------------------------------------------------------------------
# Writing state
# --------------------------------------------------------------------------------------------


class PendingSave:
    """A save whose data is still being written in the background."""

    def __init__(self, work: Callable[[], None]):
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="rlcore-checkpoint", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # reported by result()
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
    save_file(small, tmp / "state" / f"rank_{dist.rank:05d}.pt")
    tensor_keys = [k for k, v in state.items() if kind_of(k, v, state) in ("model", "optim")]
    tensors = {k: _tensor_state(k, state[k], state) for k in tensor_keys}
    if fmt == "torch":
        if not asynchronous:
            for k, sd in tensors.items():
                save_file(sd, tmp / f"{k}.pt")
            return None
        snapshot = (staging or Staging())(tensors)

        def work() -> None:
            for k, sd in snapshot.items():
                save_file(sd, tmp / f"{k}.pt")
            on_done()

        return PendingSave(work)
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(tmp / "dcp"), sync_files=True)
    with _dcp_quiet():
        if not asynchronous:
            dcp.save(tensors, storage_writer=writer, no_dist=not _dist_active())
            return None
        response = dcp.async_save(tensors, storage_writer=writer, process_group=process_group,
                                  no_dist=not _dist_active())
    future = getattr(response, "upload_completion", response)

    def wait_then_finish() -> None:
        future.result()
        on_done()

    return PendingSave(wait_then_finish)


# --------------------------------------------------------------------------------------------
# Loading state
# --------------------------------------------------------------------------------------------


def _load_file(path: Path, *, weights_only: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - any unpickling problem is a checkpoint problem
        raise CheckpointError(f"cannot load {path}: {e}") from e


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
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint entry {key!r} does not fit this run's {type(value).__name__}: {e}") from e


def load_state(path: Path, manifest: Mapping[str, Any], state: Mapping[str, Any], dist: DistInfo, *,
               seed: int) -> None:
    """Load checkpoint ``path`` into ``state`` (models, optimizers, then small state, RNG last)."""
    kinds = manifest["kinds"]
    tensor_keys = [k for k in state if kinds.get(k) in ("model", "optim")]
    if manifest["format"] == "torch":
        for k in tensor_keys:
            sd = _load_file(path / f"{k}.pt", weights_only=True)
            _apply_tensor_state(k, state[k], sd, state, full=True)
    else:
        import torch.distributed.checkpoint as dcp

        template = {k: _tensor_state(k, state[k], state) for k in tensor_keys}
        reader = dcp.FileSystemReader(str(path / "dcp"))
        try:
            with _dcp_quiet():
                dcp.load(template, storage_reader=reader, no_dist=not _dist_active())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot load sharded state from {path / 'dcp'}: {e}") from e
        for k in tensor_keys:
            _apply_tensor_state(k, state[k], template[k], state, full=False)
    saved_ws = int(manifest["world_size"])
    src = dist.rank if dist.rank < saved_ws else 0
    small = _load_file(path / "state" / f"rank_{src:05d}.pt", weights_only=False)
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


# --------------------------------------------------------------------------------------------
# Hugging Face export
# --------------------------------------------------------------------------------------------


def export_hf(model: torch.nn.Module, tokenizer: Any, target: Path, dist: DistInfo) -> Optional[str]:
    """Write ``model`` and ``tokenizer`` to ``target`` atomically; FSDP shards are gathered first (collective)."""
    if not hasattr(model, "save_pretrained"):
        raise CheckpointError(f"cannot export {type(model).__name__} as a Hugging Face directory: "
                              "it has no save_pretrained()")
    full = None
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from rlcore.rollout.adapters import is_lora

    if is_lora(model):
        return _export_lora(model, full, tokenizer, target, dist)
    if dist.is_main:
        kwargs = {"state_dict": full} if full is not None else {}
        _write_hf_dir(target, lambda d: model.save_pretrained(d, **kwargs), tokenizer)
    barrier()
    return str(target) if dist.is_main else None


def _write_hf_dir(target: Path, write: Callable[[str], None], tokenizer: Any) -> None:
    """``write(dir)`` and the tokenizer into a temporary directory, then moved to ``target`` atomically."""
    tmp = target.parent / f".tmp-{target.name}"
    remove_tree(tmp)
    try:
        write(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, target)
    except OSError as e:
        raise CheckpointError(f"could not export the model to {target}: {e}") from e


def _export_lora(model: torch.nn.Module, full: Optional[dict], tokenizer: Any, target: Path,
                 dist: DistInfo) -> Optional[str]:
    """A LoRA actor's export: the merged model at ``target`` (a plain Hugging Face directory) and the
    adapter alone at ``target-adapter`` (``peft`` format, loads on top of the base model)."""
    from rlcore.trainer.lora import lora_scale, merged_state_dict

    if dist.is_main:
        state = full if full is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
        _write_hf_dir(target.parent / f"{target.name}-adapter", lambda d: model.save_pretrained(d, state_dict=state),
                      tokenizer)
        merged = merged_state_dict(state, lora_scale(model))
        _write_hf_dir(target, lambda d: model.get_base_model().save_pretrained(d, state_dict=merged), tokenizer)
    barrier()
    return str(target) if dist.is_main else None
