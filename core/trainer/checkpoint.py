"""The default checkpoint policy: when to save, how to write atomically, what to keep, how to resume.

Layout of ``trainer.output_dir``::

    checkpoints/
      step_00000020/            one complete checkpoint
        manifest.json           step, world size, format, sha256 + size of every file (written last)
        actor.pt, actor_optim.pt, critic.pt, critic_optim.pt      "torch" format (one process, no FSDP)
        dcp/                    "dcp" format: torch.distributed.checkpoint shards of models + optimizers
        state/rank_00000.pt     small per-rank state: trainer counters, schedulers, KL controller,
                                data position, RNG streams
      latest                    name of the newest complete checkpoint (moved last)
      .tmp-step_00000030/       a save in progress (ignored by resume, removed by the next save)
    final/                      the exported Hugging Face directory
    previous-runs/<time>/       an earlier run's files, moved aside by a run with trainer.resume=disable

A save writes into ``.tmp-step_N``, fsyncs every file, writes the manifest, renames the directory
to ``step_N`` and only then replaces ``latest``. A crash at any point leaves the previous
checkpoint and pointer intact. Resume verifies the manifest (sizes and checksums) and falls back
to the previous checkpoint, with a warning, when the newest one is truncated or corrupt.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from rlcore.config.schema import TrainerConfig
from rlcore.distributed.init import any_rank, barrier, broadcast_object, new_gloo_group
from rlcore.errors import CheckpointError
from rlcore.protocols import DistInfo, Stateful
from rlcore.trainer.store import files
from rlcore.trainer.store import manifest as mf
from rlcore.trainer.store import state as stored
from rlcore.trainer.store.export import export_hf
from rlcore.trainer.store.state import RNGState

log = logging.getLogger(__name__)

#: Free space ``check_output_dir`` asks for before training starts.
MIN_FREE_BYTES = 256 * 2**20
STEP_DIR = re.compile(r"^step_(\d+)$")


# --------------------------------------------------------------------------------------------
# Preflight
# --------------------------------------------------------------------------------------------


def check_output_dir(trainer: TrainerConfig, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """Fail before any model loads when ``trainer.output_dir`` cannot hold checkpoints.

    :raises CheckpointError: the directory cannot be created, is not writable, or is (nearly) full.
    """
    path = str(trainer.output_dir)
    key = f"trainer.output_dir={path!r}"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{key} cannot be created: {e.strerror or e}") from e
    probe = os.path.join(path, f".rlcore-write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        what = "is full (no space left on device)" if e.errno == 28 else "is not writable"
        raise CheckpointError(f"{key} {what}: {e.strerror or e}") from e
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass
    free = files.free_bytes(path)
    if free is not None and free < min_free_bytes:
        raise CheckpointError(f"{key} is nearly full: {free / 2**20:.0f} MiB free, checkpoints need at least "
                              f"{min_free_bytes / 2**20:.0f} MiB; free space or choose another trainer.output_dir")


RESUME_MODES = ("auto", "disable")


def check_resume(trainer: TrainerConfig) -> None:
    """Fail before any model loads when ``trainer.resume`` names a checkpoint that is not there.

    ``auto`` and ``disable`` always pass; a path must lead to a checkpoint directory (directly, or
    through the ``latest`` pointer of a run or ``checkpoints`` directory) with a readable manifest.
    Checksums are verified at resume time.

    :raises CheckpointError: no such checkpoint (with a suggestion for a misspelt mode).
    """
    mode = str(trainer.resume or "disable")
    if mode in RESUME_MODES:
        return
    path = Path(mode)
    if not path.exists():
        import difflib

        near = difflib.get_close_matches(mode, RESUME_MODES, n=1, cutoff=0.6)
        hint = f"; did you mean '{near[0]}'?" if near else f" (use {' or '.join(RESUME_MODES)}, or a checkpoint path)"
        raise CheckpointError(f"trainer.resume={mode!r}: no such checkpoint directory{hint}")
    target = resolve_checkpoint_path(path)
    try:
        mf.read_manifest(target)
    except CheckpointError as e:
        raise CheckpointError(f"trainer.resume={mode!r}: {target} is not a complete checkpoint ({e})") from e


#: What a run writes into ``trainer.output_dir`` (``_demo`` and ``previous-runs`` are kept in place).
RUN_ARTIFACTS = ("checkpoints", "final", "metrics.jsonl", "dashboard.png", "tensorboard", "profile")
PREVIOUS_RUNS = "previous-runs"


def archive_previous_run(output_dir: str, stamp: Optional[str] = None) -> Optional[Path]:
    """Move an earlier run's artifacts (:data:`RUN_ARTIFACTS`) out of the way of a fresh run, into
    ``output_dir/previous-runs/<UTC time>/``, so that a run with ``trainer.resume=disable`` neither
    overwrites nor prunes them. Returns the archive directory, or ``None`` when there was nothing."""
    root = Path(output_dir)
    ckpts = root / "checkpoints"
    has_checkpoints = ckpts.is_dir() and ((ckpts / "latest").exists() or any(
        p.is_dir() and step_of(p) is not None for p in ckpts.iterdir()))
    if not (has_checkpoints or (root / "metrics.jsonl").is_file()):
        return None  # no sign of an earlier rlcore run: files of the user's own are left alone
    found = [name for name in RUN_ARTIFACTS if (root / name).exists()]
    import time

    base = root / PREVIOUS_RUNS / (stamp or time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    target, n = base, 1
    while target.exists():
        target, n = base.with_name(f"{base.name}-{n}"), n + 1
    target.mkdir(parents=True)
    for name in found:
        os.replace(root / name, target / name)
    unfinished = has_checkpoints and not (root / "final").exists()
    log.warning("trainer.resume=disable starts afresh: the earlier run in %s (%s) was moved to %s; nothing was "
                "deleted%s", root, ", ".join(found), target,
                " (trainer.resume=auto would have continued it)" if unfinished else "")
    return target


# --------------------------------------------------------------------------------------------
# Stateful objects the loop saves
# --------------------------------------------------------------------------------------------


class GracefulExit:
    """Turn the first SIGTERM/SIGINT into a request to stop after the current step.

    ``with GracefulExit() as stop: ... if stop.requested: save and break``. A second signal gets
    the handler that was installed before (Ctrl-C raises ``KeyboardInterrupt``, SIGTERM ends the
    process). In a multi-process job reading :attr:`requested` is a collective (every rank reads
    it at the same point), so all ranks stop at the same step when any one of them was signalled.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._flag = False
        self._previous: dict[int, Any] = {}
        self.signal_name: Optional[str] = None

    def __enter__(self) -> "GracefulExit":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._flag:
            log.warning("second %s: stopping now without a checkpoint", name)
            signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self._flag, self.signal_name = True, name
        log.warning("received %s: finishing this step, saving a checkpoint and stopping "
                    "(send it again to stop at once)", name)

    def request(self) -> None:
        """Ask for a stop as a signal would (tests, notebooks)."""
        self._flag = True

    @property
    def requested(self) -> bool:
        self._flag = any_rank(self._flag)
        return self._flag


# --------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------


class DefaultCheckpointPolicy:
    """Every ``trainer.save_steps`` and at the end; keep ``trainer.save_total_limit``; atomic; verified resume.

    :param trainer: the ``trainer`` section (``output_dir``, ``save_steps``, ``save_total_limit``,
        ``resume``, ``async_save``, ``seed``).
    :param dist: rank and world size of this process.
    """

    def __init__(self, trainer: TrainerConfig, dist: DistInfo):
        self.cfg = trainer
        self.dist = dist
        self.root = Path(trainer.output_dir) / "checkpoints"
        self._saved: dict[int, str] = {}
        self._pending: Optional[stored.PendingSave] = None
        self._gloo: Any = None
        self._staging = stored.Staging()

    # -- when -----------------------------------------------------------------------------------
    def should_save(self, step: int, *, final: bool = False) -> bool:
        if final:
            return step > 0
        every = int(self.cfg.save_steps)
        return every > 0 and step > 0 and step % every == 0

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Stateful]) -> Optional[str]:
        """Write ``state`` as checkpoint ``step`` (once per step); return its path on the main rank."""
        if step <= 0:
            return None
        if step in self._saved:
            return self._saved[step] if self.dist.is_main else None
        self.wait()
        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        if self.dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            files.remove_tree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        fmt = "dcp" if (self.dist.world_size > 1 or stored.any_sharded(state)) else "torch"
        if fmt == "dcp" and self.cfg.async_save and self._gloo is None:
            self._gloo = new_gloo_group()
        finish = lambda: self._finalize(step, tmp, final, fmt, state)  # noqa: E731
        try:
            self._pending = stored.write_state(tmp, state, fmt, self.dist, asynchronous=bool(self.cfg.async_save),
                                              on_done=finish, process_group=self._gloo,
                                              staging=self._staging)
        except OSError as e:
            raise CheckpointError(f"could not write checkpoint {final}: {e}") from e
        if self._pending is None:
            finish()
        self._saved[step] = str(final)
        return str(final) if self.dist.is_main else None

    def wait(self) -> None:
        """Block until an asynchronous save in flight is complete (and raise if it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _finalize(self, step: int, tmp: Path, final: Path, fmt: str, state: Mapping[str, Any]) -> None:
        """Manifest, rename, ``latest`` pointer, rotation. The data of every rank is on disk."""
        if self.dist.is_main:
            kinds = {k: stored.kind_of(k, v, state) for k, v in state.items()}
            try:
                mf.write_manifest(tmp, step=step, world_size=self.dist.world_size, fmt=fmt, kinds=kinds)
                files.replace_dir(tmp, final)
                files.write_pointer(self.root / "latest", final.name)
            except OSError as e:
                raise self._unfinished(final, tmp, e) from e
            self._rotate(keep=final)
            log.info("checkpoint saved: %s", final)
        if threading.current_thread() is threading.main_thread():
            barrier()

    def _unfinished(self, final: Path, tmp: Path, error: OSError) -> CheckpointError:
        """The error of a save that failed after its data was written (manifest, rename, ``latest``):
        its leftovers are removed (space back), and ``latest`` still names the previous checkpoint."""
        files.remove_tree(tmp)
        try:
            os.remove(self.root / "latest.tmp")
        except OSError:
            pass
        why = files.no_space_message(tmp, error) or f"{type(error).__name__}: {error}"
        kept = files.read_pointer(self.root / "latest")
        return CheckpointError(f"could not finish checkpoint {final}: {why}; "
                               + (f"{self.root / kept} (named by latest) is intact and trainer.resume=auto "
                                  "continues from it" if kept else "no earlier checkpoint exists"))

    def _rotate(self, keep: Path) -> None:
        limit = int(self.cfg.save_total_limit)
        complete = list_checkpoints(self.root)
        for path in complete[limit:] if limit > 0 else []:
            if path != keep:
                files.remove_tree(path)
        for stale in self.root.glob(".t*-step_*"):
            if stale.name != f".tmp-{keep.name}" and (self._pending is None or not self._pending.running()):
                files.remove_tree(stale)

    # -- resume ---------------------------------------------------------------------------------
    def resume(self, state: Mapping[str, Stateful]) -> int:
        """Load the checkpoint chosen by ``trainer.resume`` into ``state``; return its step (0 = fresh start)."""
        mode = str(self.cfg.resume or "disable")
        if mode == "disable":
            return 0
        path = self._choose(mode) if self.dist.is_main else None
        path = broadcast_object(path)
        if path is None:
            return 0
        manifest = mf.read_manifest(Path(path))
        self._check_keys(Path(path), manifest, state)
        saved_ws = int(manifest["world_size"])
        if saved_ws != self.dist.world_size and self.dist.is_main:
            log.warning("checkpoint %s was written by %d process(es), this run has %d: model and optimizer "
                        "state are resharded through torch.distributed.checkpoint; %s", path, saved_ws,
                        self.dist.world_size, stored.RESHARD_NOTE)
        stored.load_state(Path(path), manifest, state, self.dist, seed=int(self.cfg.seed))
        step = int(manifest["step"])
        self._saved[step] = path
        if self.dist.is_main:
            log.info("resumed from %s (step %d)", path, step)
        return step

    def _choose(self, mode: str) -> Optional[str]:
        if mode != "auto":
            target = resolve_checkpoint_path(Path(mode))
            problems = mf.verify(target)
            if problems:
                raise CheckpointError(f"trainer.resume={mode!r}: {target} cannot be used: " + "; ".join(problems))
            return str(target)
        for path, problems in self._candidates():
            if not problems:
                return str(path)
            log.warning("checkpoint %s is incomplete or corrupt (%s); falling back to the previous one",
                        path, "; ".join(problems))
        if any(self.root.glob("step_*")) if self.root.exists() else False:
            log.warning("no usable checkpoint in %s: starting from step 0", self.root)
        return None

    def _candidates(self):
        """``latest`` first, then older complete checkpoints, newest first, each with its problems."""
        pointer = files.read_pointer(self.root / "latest")
        found = list_checkpoints(self.root)
        order: list[Path] = []
        if pointer is not None and not _pointer_ok(pointer, self.root):
            log.warning("%s names %r, which is not a checkpoint inside %s: ignored (resume never follows a "
                        "pointer out of the run's checkpoint directory)", self.root / "latest", pointer, self.root)
            pointer = None
        if pointer is not None:
            head = self.root / pointer
            order.append(head)
            bound = step_of(head)
            found = [p for p in found if bound is None or (step_of(p) or 0) < bound]
        for path in found:
            if path not in order:
                order.append(path)
        for path in order:
            yield path, mf.verify(path)

    def _check_keys(self, path: Path, manifest: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        saved = set(manifest.get("kinds", {}))
        missing = sorted(set(state) - saved)
        if missing:
            raise CheckpointError(f"checkpoint {path} has no state for {missing} (it holds {sorted(saved)}): "
                                  "the run's setup differs from the saved one (e.g. a critic was added); "
                                  "set trainer.resume=disable or use a matching config")
        extra = sorted(saved - set(state))
        if extra and self.dist.is_main:
            log.warning("checkpoint %s holds %s that this run does not use; ignored", path, extra)

    # -- export ---------------------------------------------------------------------------------
    def export(self, model: torch.nn.Module, tokenizer: Any, name: str = "final") -> Optional[str]:
        """Write ``model`` (gathered from its shards when FSDP-wrapped) and ``tokenizer`` as a HF directory."""
        self.wait()
        return export_hf(model, tokenizer, Path(self.cfg.output_dir) / name, self.dist)


def step_of(path: Path) -> Optional[int]:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: Path) -> list[Path]:
    """Renamed (finished) checkpoint directories under ``root``, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)


def _pointer_ok(pointer: str, root: Path) -> bool:
    """A ``latest`` pointer names a ``step_N`` directory of ``root`` itself (no path, no link out)."""
    return STEP_DIR.match(pointer) is not None and files.inside(root / pointer, root)


def resolve_checkpoint_path(path: Path) -> Path:
    """A checkpoint directory given directly, or the ``latest`` one of a run or ``checkpoints`` directory."""
    for root in (path, path / "checkpoints"):
        pointer = files.read_pointer(root / "latest")
        if pointer is not None:
            if not _pointer_ok(pointer, root):
                raise CheckpointError(f"trainer.resume={str(path)!r}: {root / 'latest'} names {pointer!r}, which is "
                                      f"not a checkpoint inside {root}; refusing to follow it")
            return root / pointer
    if not path.exists():
        raise CheckpointError(f"trainer.resume={str(path)!r}: no such checkpoint directory")
    return path


__all__ = ["DefaultCheckpointPolicy", "RNGState", "GracefulExit", "check_output_dir", "list_checkpoints",
           "resolve_checkpoint_path", "MIN_FREE_BYTES"]
