"""Observability commands of ``rlcore``: ``monitor``, ``profile-report``, ``plot``.

:func:`add_commands` adds them to the ``rlcore`` argument parser; each handler returns an exit code.
"""

from __future__ import annotations

import argparse
import glob
import os

from rlcore.errors import RLCoreError


def cmd_monitor(args: argparse.Namespace) -> int:
    from rlcore.observe.gpu import run_monitor

    if args.interval <= 0:
        raise RLCoreError(f"--interval must be > 0, got {args.interval}")
    return run_monitor(args.interval, args.count)


def expand_traces(paths: list[str]) -> list[str]:
    """Trace files named directly, or every ``*.json``/``*.json.gz`` in a run or profile directory."""
    found: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            root = os.path.join(p, "profile") if os.path.isdir(os.path.join(p, "profile")) else p
            found += sorted(glob.glob(os.path.join(root, "*.json")) + glob.glob(os.path.join(root, "*.json.gz")))
        elif os.path.isfile(p):
            found.append(p)
        else:
            raise RLCoreError(f"no such trace file or directory: {p}")
    if not found:
        raise RLCoreError(f"no trace files in {', '.join(paths)} (run with trainer.enable_profiling=true)")
    return found


def cmd_profile_report(args: argparse.Namespace) -> int:
    from rlcore.observe.profile_report import INVESTIGATE_SHARE, report

    paths = expand_traces(args.traces)
    try:
        lines, overall = report(paths, kernels=args.kernels, gaps=args.gaps, within=args.within)
    except (OSError, ValueError) as e:
        raise RLCoreError(f"cannot read trace: {e}") from e
    print("\n".join(lines))
    if args.fail_over is not None:
        return 1 if overall.share("communication") > args.fail_over else 0
    return 0 if overall.share("communication") <= INVESTIGATE_SHARE or not args.strict else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from rlcore.observe.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"dashboard written: {path}")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``monitor``, ``profile-report`` and ``plot`` to the ``rlcore`` parser."""
    p = subparsers.add_parser("monitor", help="print live GPU utilisation and memory (NVML)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between samples (default 1)")
    p.add_argument("--count", type=int, default=0, metavar="N", help="samples to take (default 0: until Ctrl-C)")
    p.set_defaults(func=cmd_monitor)

    p = subparsers.add_parser("profile-report", help="time share by category (communication, compute, memcpy, "
                                                     "idle) of profiler traces")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="Chrome trace files, or a run/profile directory")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also list the N largest kernels (GPU traces) or operators (CPU traces) by total time")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="GPU traces: where the device sat idle (stretches of 0.1 ms or more), by the host op "
                        "running in them, and the N longest")
    p.add_argument("--within", default=None, metavar="NAME",
                   help="with --gaps: only the time inside the host ranges named NAME (the trainer marks "
                        "rlcore.generate, rlcore.update, rlcore.update.micro_batch ...)")
    p.add_argument("--strict", action="store_true", help="exit 1 when communication exceeds 20%%")
    p.add_argument("--fail-over", type=float, default=None, metavar="SHARE",
                   help="exit 1 when the communication share exceeds SHARE (0-1)")
    p.set_defaults(func=cmd_profile_report)

    p = subparsers.add_parser("plot", help="draw RUN_DIR/metrics.jsonl as a PNG dashboard")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", default=None, metavar="PNG", help="output path (default RUN_DIR/dashboard.png)")
    p.set_defaults(func=cmd_plot)
