"""``rlcore train trainer.nproc_per_node=N``: start torch's own elastic launcher on this node.

This is exactly ``torchrun --standalone --nproc_per_node=N -m rlcore train <same arguments>``:
torch elastic starts, watches and stops the worker processes; rlcore adds no process management.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from typing import Any, Mapping, Optional, Sequence

from rlcore.errors import EXIT_INTERRUPTED, EXIT_OK, RLCoreError

log = logging.getLogger(__name__)

#: Set by torchrun in every worker; its presence means "already launched".
LAUNCHED_MARKERS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")

#: Seconds torch elastic lets the workers finish after a SIGTERM/SIGINT before it kills them (its
#: own default is 30, less than a training step plus a checkpoint save of a real model). The
#: environment variable ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, when set, wins.
SHUTDOWN_TIMEOUT_S = 900


def under_launcher() -> bool:
    """True inside a process started by torchrun (or another launcher that set ``WORLD_SIZE``)."""
    return any(os.environ.get(k) for k in LAUNCHED_MARKERS) or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def launcher_args(nproc_per_node: int, argv: Sequence[str], monitor_interval: float = 0.5) -> list[str]:
    """The ``torch.distributed.run`` command line that re-runs ``rlcore train <argv>`` in ``nproc_per_node`` processes."""
    return ["--standalone", f"--nproc_per_node={int(nproc_per_node)}", f"--monitor_interval={monitor_interval}",
            "-m", "rlcore", "train", *[str(a) for a in argv]]


def maybe_launch(nproc_per_node: int, argv: Sequence[str]) -> Optional[int]:
    """Start ``nproc_per_node`` workers with torch elastic when asked and not already a worker.

    :param nproc_per_node: ``trainer.nproc_per_node``.
    :param argv: the arguments after ``rlcore train`` (config file and overrides), passed unchanged.
    :returns: None when this process should train itself (``nproc_per_node`` <= 1, or already under
        torchrun); else the exit code of the job: ``EXIT_OK`` when every worker completed,
        ``EXIT_INTERRUPTED`` when a signal stopped them (they finish their step and save first).
    :raises RLCoreError: a worker failed; the message names the first failing rank and its exit code.
    """
    n = int(nproc_per_node)
    if n < 1:
        raise RLCoreError(f"trainer.nproc_per_node must be >= 1, got {n}")
    if n == 1 or under_launcher():
        return None
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    args = parse_args(launcher_args(n, argv))
    log.info("starting %d worker processes with torch.distributed.run (torchrun)", n)
    try:
        run(args)
    except SignalException as e:  # the workers got the signal too, finished their step and saved
        log.warning("stopped by signal %s: the workers were given up to %s s to finish their step and save a "
                    "checkpoint (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)", getattr(e, "sigval", "?"),
                    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        return EXIT_INTERRUPTED
    except ChildFailedError as e:
        if e.failures and all(f.exitcode == EXIT_INTERRUPTED for f in e.failures.values()):
            return EXIT_INTERRUPTED  # a worker was signalled: every rank stopped at the same step and saved
        raise RLCoreError(failure_report(e.failures)) from e
    return EXIT_OK


#: What a rank's error says when it only lost a peer (the peer's own failure is the cause).
PEER_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|BridgeError|the rank may have died|"
                       r"connection refused|socket timeout|NCCL communicator was aborted", re.I)


def first_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The rank whose failure most likely caused the others: one that died of a signal (not the
    launcher's stop signals) first, then one that exited with an error of its own rather than being
    stopped by the launcher (SIGTERM/SIGINT: torchrun stops the others once one fails), then one whose
    error is not the loss of a peer, then the earliest (torchrun's timestamps have one-second steps: a
    tie goes to the lowest rank)."""
    stops = (signal.SIGTERM, signal.SIGINT)

    def key(item: tuple[int, Any]) -> tuple:
        rank, f = item
        signalled = int(f.exitcode) < 0
        killed = signalled and -int(f.exitcode) not in stops
        stopped = signalled and not killed
        return (not killed, stopped, bool(PEER_LOST.search(failure_detail(f.message))), int(f.timestamp), rank)

    return min(failures.items(), key=key)


def failure_report(failures: Mapping[int, Any]) -> str:
    """One message for a failed job: the rank that died first with its error, then the others."""
    def how(f: Any) -> str:
        code = int(f.exitcode)
        return f"code {code}" if code >= 0 else f"signal {-code} ({f.signal_name()})"

    rank, failure = first_failure(failures)
    detail = failure_detail(failure.message)
    text = (f"distributed training failed: rank {rank} exited with {how(failure)}"
            f"{': ' + detail if detail else ' (its error is printed above)'}")
    others = sorted(r for r in failures if r != rank)
    if others:
        text += "; after it: " + ", ".join(f"rank {r} ({how(failures[r])})" for r in others)
    return text + "; the other ranks were stopped"


def failure_detail(message) -> str:
    """The text of a failed worker's record (torchrun's ``ProcessFailure.message``): a string, or the
    error file's ``{"message": ..., "extraInfo": ...}`` mapping; ``""`` when it only says how to get a
    traceback."""
    if isinstance(message, dict):
        message = message.get("message") or ""
    message = str(message or "")
    return "" if "enable traceback" in message else message
