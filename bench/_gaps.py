"""Where a GPU sat idle inside a profiled region, and what the host was doing meanwhile.

:func:`idle_report` takes the device's busy intervals (kernels, copies, fills) and the host's op
intervals (with ``torch.profiler.record_function`` ranges among them) and reports the region's busy
share and every idle gap: each gap is put down to the innermost host op running at its middle, with
the ops around it (``rlcore.update.micro_batch > aten::item > cudaStreamSynchronize``). :func:`from_profile`
reads both from a ``torch.profiler.profile`` run. Times are microseconds, as the profiler's.

The profiler slows the host, so host-bound gaps come out longer than without it: compare the
attributions with each other, not the idle share with an unprofiled run."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint ``(start, end)`` pairs (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def _chain(ops: list[tuple[float, float, str]], at: float, depth: int) -> list[str]:
    """Names of the host ops running at ``at``, outermost first, the last ``depth`` of them (an op that
    starts later inside another is nested in it; ties: the longer one is outer)."""
    active = sorted((op for op in ops if op[0] <= at < op[1]), key=lambda op: (op[0], -op[1]))
    return [name for _, _, name in active][-depth:]


def idle_report(busy: Iterable[tuple[float, float]], ops: Iterable[tuple[float, float, str]],
                window: tuple[float, float], *, min_gap_us: float = 100.0, top: int = 15,
                depth: int = 3) -> dict[str, Any]:
    """The device's busy share of ``window`` and its idle gaps.

    ``busy``: device intervals; ``ops``: host ``(start, end, name)``; gaps of at least ``min_gap_us``
    are listed (the ``top`` longest) and summed by the innermost host op at their middle
    (``idle_by_op``); shorter ones are only counted (``short_gaps``)."""
    t0, t1 = window
    if t1 <= t0:
        raise ValueError(f"idle_report: empty window {window}")
    merged = [(max(s, t0), min(e, t1)) for s, e in merge(busy) if e > t0 and s < t1]
    ops = [op for op in ops if op[1] > t0 and op[0] < t1]
    gaps, cursor = [], t0
    for start, end in merged + [(t1, t1)]:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    long_gaps, by_op = [], defaultdict(lambda: [0, 0.0])
    short = [0, 0.0]
    for start, end in gaps:
        length = end - start
        if length < min_gap_us:
            short[0] += 1
            short[1] += length
            continue
        chain = _chain(ops, (start + end) / 2, depth) or ["(no host op)"]
        long_gaps.append({"at_ms": (start - t0) / 1e3, "ms": length / 1e3, "during": " > ".join(chain)})
        by_op[chain[-1]][0] += 1
        by_op[chain[-1]][1] += length
    busy_us = sum(e - s for s, e in merged)
    span = t1 - t0
    return {
        "window_s": span / 1e6, "busy_s": busy_us / 1e6, "idle_s": (span - busy_us) / 1e6,
        "busy_frac": busy_us / span,
        "gaps": {"count": len(long_gaps), "s": sum(g["ms"] for g in long_gaps) / 1e3, "min_us": min_gap_us},
        "short_gaps": {"count": short[0], "s": short[1] / 1e6},
        "idle_by_op": [{"op": name, "gaps": n, "s": us / 1e6}
                       for name, (n, us) in sorted(by_op.items(), key=lambda kv: -kv[1][1])][:top],
        "longest_gaps": sorted(long_gaps, key=lambda g: -g["ms"])[:top],
    }


def from_profile(prof, window_name: str, **kwargs) -> Optional[dict[str, Any]]:
    """:func:`idle_report` of a finished ``torch.profiler.profile`` over the first host range named
    ``window_name`` (a ``record_function``); None if the run recorded no such range."""
    from torch.autograd import DeviceType

    busy, ops, window = [], [], None
    for event in prof.events():
        start, end = float(event.time_range.start), float(event.time_range.end)
        if event.device_type == DeviceType.CPU:
            ops.append((start, end, event.name))
            if window is None and event.name == window_name:
                window = (start, end)
        else:  # kernels, copies and fills on the device
            busy.append((start, end))
    if window is None:
        return None
    report = idle_report(busy, ops, window, **kwargs)
    report["device_events"] = len(busy)
    return report


def format_report(report: dict[str, Any]) -> str:
    """A few lines for a log: the busy share, then where the idle time went."""
    lines = [f"window {report['window_s']:.3f} s: device busy {report['busy_s']:.3f} s "
             f"({100 * report['busy_frac']:.1f}%), idle {report['idle_s']:.3f} s; "
             f"{report['gaps']['count']} gaps >= {report['gaps']['min_us']:.0f} us = {report['gaps']['s']:.3f} s, "
             f"{report['short_gaps']['count']} shorter = {report['short_gaps']['s']:.3f} s"]
    lines += [f"  idle {row['s']:.3f} s in {row['gaps']} gaps during {row['op']}" for row in report["idle_by_op"]]
    lines += [f"  gap {g['ms']:.2f} ms at {g['at_ms']:.1f} ms: {g['during']}" for g in report["longest_gaps"][:8]]
    return "\n".join(lines)
