"""``rlcore profile-report``: where the time of a profiled window went, from Chrome traces.

Every moment of the profiled window is given to exactly one category, in this priority:
**communication** (NCCL/gloo collectives) > **memcpy** (copies and memsets) > **compute** (every
other kernel or operator) > **idle** (nothing running). Shares therefore add up to 100%, and
communication that overlaps computation counts as communication (the separate ``overlapped``
figure says how much of it ran alongside compute).

Traces holding GPU activity are read on the device timeline (kernels, per GPU); CPU-only traces
(gloo) on the operator timeline of all threads. The seed's rule for the communication share:
under 12% is healthy, above 12% deserves a look, above 20% calls for checking the remeshing or
FSDP settings.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

WARN_SHARE = 0.12
INVESTIGATE_SHARE = 0.20
CATEGORIES = ("communication", "memcpy", "compute", "idle")

COMM_PATTERN = re.compile(
    r"nccl|gloo|c10d::|c10d_functional|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|"
    r"all_?to_?all|barrier", re.IGNORECASE)
CPU_MEMCPY_PATTERN = re.compile(r"^(aten::copy_|aten::_to_copy|aten::to|aten::pin_memory|aten::_pin_memory)$")
GPU_KERNEL_CATS = {"kernel"}
GPU_MEMCPY_CATS = {"gpu_memcpy", "gpu_memset"}
STEP_PATTERN = re.compile(r"^ProfilerStep#\d+$")

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of ``[start, end)`` intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` minus ``b``; both merged (sorted, disjoint)."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    return subtract(a, subtract(a, b))


def clip(intervals: Sequence[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


@dataclass
class Breakdown:
    """Microseconds per category over ``window_us`` for one timeline (or a sum of timelines)."""

    source: str
    mode: str  # "gpu" | "cpu"
    window_us: float = 0.0
    us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    overlapped_us: float = 0.0
    top_comm: dict[str, float] = field(default_factory=dict)
    #: name -> [microseconds, calls] of every kernel (GPU timeline) or operator (CPU timeline)
    top_kernels: dict[str, list[float]] = field(default_factory=dict)

    def share(self, category: str) -> float:
        return self.us[category] / self.window_us if self.window_us > 0 else 0.0

    def add(self, other: "Breakdown") -> None:
        self.window_us += other.window_us
        self.overlapped_us += other.overlapped_us
        for k in CATEGORIES:
            self.us[k] += other.us[k]
        for k, v in other.top_comm.items():
            self.top_comm[k] = self.top_comm.get(k, 0.0) + v
        for k, (us, calls) in other.top_kernels.items():
            mine = self.top_kernels.setdefault(k, [0.0, 0])
            mine[0] += us
            mine[1] += calls


def partition(window: Interval, comm: list[Interval], memcpy: list[Interval], compute: list[Interval],
              source: str, mode: str) -> Breakdown:
    """Give each moment of ``window`` to one category (communication > memcpy > compute > idle)."""
    comm, memcpy, compute = (merge(clip(x, window)) for x in (comm, memcpy, compute))
    mem_only = subtract(memcpy, comm)
    compute_only = subtract(subtract(compute, comm), memcpy)
    b = Breakdown(source=source, mode=mode, window_us=window[1] - window[0])
    b.us["communication"] = total(comm)
    b.us["memcpy"] = total(mem_only)
    b.us["compute"] = total(compute_only)
    b.us["idle"] = max(0.0, b.window_us - b.us["communication"] - b.us["memcpy"] - b.us["compute"])
    b.overlapped_us = total(intersect(comm, compute))
    return b


def load_events(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def _span(e: dict[str, Any]) -> Interval:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def _window(events: list[dict[str, Any]], fallback: list[dict[str, Any]]) -> Optional[Interval]:
    steps = [_span(e) for e in events if STEP_PATTERN.match(str(e.get("name", "")))]
    spans = steps or [_span(e) for e in fallback]
    if not spans:
        return None
    return min(s for s, _ in spans), max(e for _, e in spans)


def _tally(events: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for e in events:
        entry = out.setdefault(str(e.get("name", "")), [0.0, 0])
        entry[0] += float(e["dur"])
        entry[1] += 1
    return out


def _top(events: Iterable[dict[str, Any]]) -> dict[str, float]:
    return {name: us for name, (us, _) in _tally(events).items()}


def analyze_events(events: list[dict[str, Any]], source: str = "trace") -> Breakdown:
    """Breakdown of one trace's events (GPU timeline when it has kernels, else CPU operators)."""
    gpu = [e for e in events if e.get("cat") in GPU_KERNEL_CATS | GPU_MEMCPY_CATS]
    if gpu:
        result = Breakdown(source=source, mode="gpu")
        window = _window(events, gpu)
        for pid in sorted({e.get("pid") for e in gpu}, key=str):
            dev = [e for e in gpu if e.get("pid") == pid]
            kernels = [e for e in dev if e.get("cat") in GPU_KERNEL_CATS]
            comm_ev = [e for e in kernels if COMM_PATTERN.search(str(e.get("name", "")))]
            comm = [_span(e) for e in comm_ev]
            compute = [_span(e) for e in kernels if not COMM_PATTERN.search(str(e.get("name", "")))]
            memcpy = [_span(e) for e in dev if e.get("cat") in GPU_MEMCPY_CATS]
            part = partition(window or _window([], dev), comm, memcpy, compute, source, "gpu")
            part.top_comm = _top(comm_ev)
            part.top_kernels = _tally(dev)
            result.add(part)
        return result
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
           and not STEP_PATTERN.match(str(e.get("name", "")))]
    is_comm = [bool(COMM_PATTERN.search(str(e.get("name", "")))) for e in ops]
    comm_ev = [e for e, c in zip(ops, is_comm) if c]
    busy = [e for e, c in zip(ops, is_comm) if not c and e.get("cat") == "cpu_op"]
    window = _window(events, ops)
    if window is None:
        return Breakdown(source=source, mode="cpu")
    memcpy = [_span(e) for e in busy if CPU_MEMCPY_PATTERN.match(str(e.get("name", "")))]
    part = partition(window, [_span(e) for e in comm_ev], memcpy, [_span(e) for e in busy], source, "cpu")
    part.top_comm = _top(e for e in comm_ev if str(e.get("name", "")).startswith(("nccl", "gloo")))
    part.top_kernels = _tally(busy)
    return part


#: host events that say what the host was doing (operators, ``record_function`` ranges, CUDA API calls)
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


@dataclass
class Gap:
    """A stretch with nothing running on the device: ``start_us`` from the window's start, its length,
    and the host's ops at its middle, outermost first (on the thread whose innermost op began last)."""

    start_us: float
    dur_us: float
    host: tuple[str, ...]


def device_intervals(events: list[dict[str, Any]]) -> list[Interval]:
    """The times a GPU trace's device was running a kernel or a copy (merged)."""
    return merge(_span(e) for e in events if e.get("cat") in GPU_KERNEL_CATS | GPU_MEMCPY_CATS)


def busy_share(events: list[dict[str, Any]], ranges: Sequence[Interval]) -> float:
    """The share of the ``ranges``' time the device was running something (0 without ranges)."""
    span = total(ranges)
    device = device_intervals(events)
    return sum(total(clip(device, r)) for r in ranges) / span if span else 0.0


def idle_gaps(events: list[dict[str, Any]], min_us: float = 100.0, window_name: Optional[str] = None,
              within: Optional[str] = None, depth: int = 3) -> tuple[list[Gap], list[Interval]]:
    """The device's idle stretches of at least ``min_us`` in a GPU trace, in time order, each with what
    the host was doing (the last ``depth`` ops of the nesting), and the ranges looked at: the trace's
    window (its profiler steps), or the first host range named ``window_name``, or every host range
    named ``within`` (``rlcore.update``: the updates of all the profiled steps). ``start_us`` counts
    from the first range's start. No device activity, or no such range: no gaps."""
    device = device_intervals(events)
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and not STEP_PATTERN.match(str(e.get("name", "")))),
                  key=lambda e: (float(e["ts"]), -float(e["dur"])))
    if within is not None:
        ranges = merge(_span(e) for e in host if e.get("name") == within)
    elif window_name is not None:
        ranges = [_span(e) for e in host if e.get("name") == window_name][:1]
    else:
        window = _window(events, [{"ts": s, "dur": e - s} for s, e in device]) if device else None
        ranges = [window] if window is not None else []
    if not ranges or not device:
        return [], ranges
    starts = [s for s, _ in device]
    stretches = []
    for lo, hi in ranges:
        cursor, k = lo, max(0, bisect.bisect_right(starts, lo) - 1)
        for s, e in clip(device[k:bisect.bisect_left(starts, hi)], (lo, hi)) + [(hi, hi)]:
            if s - cursor >= min_us:
                stretches.append((cursor, s))
            cursor = max(cursor, e)
    gaps, stacks, i = [], {}, 0
    for start, end in stretches:  # a sweep: each thread's open ops as a stack, at each gap's middle
        middle = (start + end) / 2
        while i < len(host) and float(host[i]["ts"]) <= middle:
            stack = stacks.setdefault((host[i].get("pid"), host[i].get("tid")), [])
            while stack and stack[-1][1] <= float(host[i]["ts"]):
                stack.pop()
            stack.append((*_span(host[i]), str(host[i].get("name", ""))))
            i += 1
        chains = []
        for stack in stacks.values():
            while stack and stack[-1][1] <= middle:
                stack.pop()
            open_ops = [op for op in stack if op[1] > middle]
            if open_ops:
                chains.append((open_ops[-1][0], tuple(name for _, _, name in open_ops[-depth:])))
        gaps.append(Gap(start - ranges[0][0], end - start, max(chains)[1] if chains else ()))
    return gaps, ranges


def summarize_gaps(gaps: list[Gap], ranges: Sequence[Interval], top: int = 15) -> dict[str, Any]:
    """``gaps`` in figures: their count and idle seconds (and share of the ``ranges``' time), the idle
    seconds by the innermost host op they fell in (``by_host_op``, largest first) and the ``top`` longest."""
    span = total(ranges)
    by_op: dict[str, list[float]] = {}
    for g in gaps:
        entry = by_op.setdefault(g.host[-1] if g.host else "(no host op)", [0.0, 0])
        entry[0] += g.dur_us
        entry[1] += 1
    idle = sum(g.dur_us for g in gaps)
    return {"window_s": span / 1e6, "ranges": len(ranges), "count": len(gaps), "idle_s": idle / 1e6,
            "idle_frac": idle / span if span else 0.0,
            "by_host_op": [{"op": name, "s": us / 1e6, "count": int(n)}
                           for name, (us, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]],
            "longest": [{"ms": g.dur_us / 1e3, "at_ms": g.start_us / 1e3, "host": " > ".join(g.host)}
                        for g in sorted(gaps, key=lambda g: -g.dur_us)[:top]]}


def format_gaps(gaps: list[Gap], ranges: Sequence[Interval], top: int, within: Optional[str] = None) -> list[str]:
    """Report lines: the idle time of ``gaps`` by the host op it fell in, then the ``top`` longest."""
    summary = summarize_gaps(gaps, ranges, top)
    where = f"{summary['ranges']} ranges named {within}" if within else "the window"
    lines = [f"  idle stretches: {summary['count']}, {summary['idle_s'] * 1e3:.1f} ms "
             f"({summary['idle_frac'] * 100:.1f}% of {where}), by the host op running in them:"]
    lines += [f"    {row['s'] * 1e3:10.2f} ms {row['count']:7d}x  {row['op'][:90]}" for row in summary["by_host_op"]]
    lines.append("  longest idle stretches (ms, at ms from the first range's start, the host's ops):")
    lines += [f"    {g['ms']:8.2f} at {g['at_ms']:10.1f}  {g['host'] or '(no host op)'}" for g in summary["longest"]]
    return lines


def analyze_trace(path: str) -> Breakdown:
    return analyze_events(load_events(path), source=path)


def verdict(comm_share: float) -> tuple[str, str]:
    """(level, advice) for a communication share."""
    if comm_share > INVESTIGATE_SHARE:
        return "INVESTIGATE", (f"communication above {INVESTIGATE_SHARE:.0%}: check actor.remeshing and fsdp "
                               "(sharding_strategy, training_shard_size) and trainer.gradient_accumulation_steps")
    if comm_share > WARN_SHARE:
        return "WARN", f"communication above the healthy {WARN_SHARE:.0%}"
    return "OK", f"communication under {WARN_SHARE:.0%}"


def format_breakdown(b: Breakdown, title: Optional[str] = None, kernels: int = 0) -> list[str]:
    """Report lines for ``b``; ``kernels`` > 0 adds that many of its largest kernels (or CPU operators;
    nested operators each count their own span)."""
    lines = [f"{title or b.source}  [{b.mode} timeline, window {b.window_us / 1e3:.1f} ms]"]
    for cat in CATEGORIES:
        lines.append(f"  {cat:<14} {b.share(cat) * 100:6.1f}%  {b.us[cat] / 1e3:10.1f} ms")
    if b.us["communication"] > 0:
        lines.append(f"  (communication overlapped with compute: {b.overlapped_us / 1e3:.1f} ms)")
        for name, us in sorted(b.top_comm.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"    {name[:70]:<70} {us / 1e3:9.1f} ms")
    level, advice = verdict(b.share("communication"))
    lines.append(f"  {level}: {advice}")
    if kernels > 0 and b.top_kernels:
        what = "kernels and copies" if b.mode == "gpu" else "operators"
        lines.append(f"  largest {what} (total ms, calls, share of the window):")
        for name, (us, calls) in sorted(b.top_kernels.items(), key=lambda kv: -kv[1][0])[:kernels]:
            share = us / b.window_us * 100 if b.window_us > 0 else 0.0
            lines.append(f"    {us / 1e3:10.2f} ms {int(calls):7d}x {share:5.1f}%  {name[:90]}")
    return lines


def report(paths: Sequence[str], kernels: int = 0, gaps: int = 0,
           within: Optional[str] = None) -> tuple[list[str], Breakdown]:
    """Lines for every trace plus a total over all of them (with ``kernels`` largest kernels each, and
    with ``gaps`` > 0 where each GPU trace's idle time fell, in the host ranges named ``within`` if
    given: :func:`idle_gaps`); the total breakdown."""
    lines: list[str] = []
    overall: Optional[Breakdown] = None
    for path in paths:
        events = load_events(path)
        b = analyze_events(events, source=path)
        lines += format_breakdown(b, kernels=kernels)
        if gaps > 0 and b.mode == "gpu":
            found, ranges = idle_gaps(events, within=within)
            lines += (format_gaps(found, ranges, gaps, within) if ranges else
                      [f"  idle stretches: none listed, no host range named {within} in this trace"])
        elif gaps > 0:
            lines.append("  idle stretches: none listed, a CPU trace has no device timeline (--gaps reads GPU traces)")
        lines.append("")
        if overall is None:
            overall = Breakdown(source="all traces", mode=b.mode)
        overall.add(b)
    if overall is not None and len(paths) > 1:
        lines += format_breakdown(overall, title=f"all {len(paths)} traces", kernels=kernels)
    return lines, overall or Breakdown(source="none", mode="cpu")
