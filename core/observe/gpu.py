"""GPU utilisation and memory sampled with NVML (``nvidia-ml-py``) in a background thread.

The seed's health rule: during training utilisation stays within 85-95% with no long dips under
70%. :func:`summarize` turns samples into ``gpu/util_mean``, ``gpu/util_p10``, the longest dip
under 70% and a ``gpu/healthy`` flag (mean >= 85 and p10 >= 70). Without a GPU or NVML the
monitor is disabled: ``available`` is False and summaries are empty.

Each reading carries the phase the monitor was in (:meth:`GPUMonitor.set_phase`): ``generate``,
``train``, or :data:`OUTSIDE` for readings taken between training steps (evaluation, checkpoint
saves, a benchmark's warm-up or CUDA graph capture). The health summary covers the in-step readings
only; the outside ones are reported apart (``gpu/util_mean_outside``, ``gpu/outside_s``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)

HEALTHY_MEAN = 85.0
DIP_UNDER = 70.0

#: phase of readings taken during a rollout
GENERATE = "generate"
#: phase of readings taken in a training step outside its rollout (the monitor's default)
TRAIN = "train"
#: phase of readings taken between training steps: left out of the health summary, reported apart
OUTSIDE = "outside"


@dataclass(frozen=True)
class Sample:
    """One reading of one GPU."""

    util: float  # percent
    mem_used_gb: float
    mem_total_gb: float


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0-100) of a non-empty sequence."""
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def longest_run_below(values: Sequence[float], threshold: float,
                      breaks: Optional[Sequence[bool]] = None) -> int:
    """Length of the longest run of consecutive values under ``threshold``.

    :param breaks: per value, True where the value is not counted and ends the current run (a
        reading taken outside a training step); None: every value counts.
    """
    best = run = 0
    for i, v in enumerate(values):
        if breaks is not None and breaks[i]:
            run = 0
            continue
        run = run + 1 if v < threshold else 0
        best = max(best, run)
    return best


def summarize(util: Sequence[float], mem_used_gb: Sequence[float], interval_s: float,
              phases: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Summary metrics of one device's utilisation (%) and memory (GB) samples taken every ``interval_s``.

    :param phases: the phase of each ``util`` sample; those tagged :data:`OUTSIDE` are left out of
        the utilisation and health keys, and end a dip (a run of low readings never joins across
        them). None: every sample is in a step.
    :returns: ``{}`` without samples. When every sample is outside a step, only
        ``gpu/mem_used_gb_max`` (which always covers every sample): the utilisation and health keys
        are left out rather than summarising nothing.
    :raises ValueError: ``phases`` is not as long as ``util``.
    """
    if not util:
        return {}
    if phases is not None and len(phases) != len(util):
        raise ValueError(f"summarize: {len(phases)} phases for {len(util)} utilisation samples")
    outside = [p == OUTSIDE for p in phases] if phases is not None else [False] * len(util)
    out = {"gpu/mem_used_gb_max": float(max(mem_used_gb)) if mem_used_gb else 0.0}
    in_step = [u for u, o in zip(util, outside) if not o]
    if not in_step:
        return out
    mean = sum(in_step) / len(in_step)
    p10 = percentile(in_step, 10)
    out.update({
        "gpu/util_mean": mean,
        "gpu/util_p10": p10,
        "gpu/util_min": float(min(in_step)),
        "gpu/dip_frac": sum(u < DIP_UNDER for u in in_step) / len(in_step),
        "gpu/longest_dip_s": longest_run_below(util, DIP_UNDER, outside) * interval_s,
        "gpu/samples": float(len(in_step)),
        "gpu/healthy": 1.0 if (mean >= HEALTHY_MEAN and p10 >= DIP_UNDER) else 0.0,
    })
    return out


#: share of a rollout's readings, at its end, that make its tail (``gpu/util_mean_generate_tail``)
TAIL_SHARE = 0.25


def phase_summary(readings: dict[str, list[list[float]]]) -> dict[str, float]:
    """Per phase, its readings in order (each a list over devices): ``gpu/util_mean_<phase>`` and
    ``gpu/util_p10_<phase>`` (only the mean for :data:`OUTSIDE`: it is not held to the health rule),
    and for ``generate`` the mean of its last :data:`TAIL_SHARE` of readings
    (``gpu/util_mean_generate_tail``: the long tail of a rollout, few sequences left)."""
    out: dict[str, float] = {}
    for phase, rows in readings.items():
        values = [u for row in rows for u in row]
        if not values:
            continue
        out[f"gpu/util_mean_{phase}"] = sum(values) / len(values)
        if phase != OUTSIDE:
            out[f"gpu/util_p10_{phase}"] = percentile(values, 10)
        if phase == GENERATE:
            tail = [u for row in rows[len(rows) - max(1, round(len(rows) * TAIL_SHARE)):] for u in row]
            out["gpu/util_mean_generate_tail"] = sum(tail) / len(tail)
    return out


class NVMLReader:
    """Reads utilisation and memory of a set of NVML devices."""

    def __init__(self, indices: Optional[Sequence[int]] = None):
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise RuntimeError("NVML sees no GPU")
        self.indices = list(indices) if indices is not None else list(range(count))
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        self.names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]

    def read(self) -> list[Sample]:
        out = []
        for h in self._handles:
            util = self._nvml.nvmlDeviceGetUtilizationRates(h)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
            out.append(Sample(float(util.gpu), mem.used / 1e9, mem.total / 1e9))
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down twice is harmless
            pass


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def local_nvml_index() -> Optional[int]:
    """The NVML index of this process's current CUDA device (honouring numeric ``CUDA_VISIBLE_DEVICES``)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        current = torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return current
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if current < len(ids) and ids[current].isdigit():
        return int(ids[current])
    return None


def open_reader(indices: Optional[Sequence[int]] = None) -> tuple[Optional[NVMLReader], str]:
    """An NVML reader, or None and the reason none is available."""
    try:
        return NVMLReader(indices), ""
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, driver not loaded, no device
        return None, f"NVML is not usable here ({e})"


class GPUMonitor:
    """Sample GPUs every ``interval_s`` seconds in a daemon thread between :meth:`start` and :meth:`stop`.

    :param interval_s: seconds between samples; <= 0 disables the monitor.
    :param devices: NVML indices to watch; None = this process's CUDA device, or every GPU when
        the process has no CUDA context.
    :param reader_factory: builds the reader (tests pass a fake); default NVML.
    :param phase: the phase of the first readings (see :meth:`set_phase`); the default :data:`TRAIN`
        counts every reading in the health summary until the phase is changed.
    """

    def __init__(self, interval_s: float = 0.5, devices: Optional[Sequence[int]] = None,
                 reader_factory: Optional[Callable[[], object]] = None, phase: str = TRAIN):
        self.interval_s = float(interval_s)
        self.devices = devices
        self._factory = reader_factory
        self._reader: Optional[object] = None
        self.reason = "disabled (interval <= 0)" if self.interval_s <= 0 else ""
        self._util: list[list[float]] = []
        self._mem: list[list[float]] = []
        self._phases: list[str] = []  # the phase of each reading (see set_phase)
        self.phase = str(phase)
        self._mark = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: no reader could be opened: later :meth:`start` calls neither retry nor log again
        self._gave_up = False

    @property
    def available(self) -> bool:
        return self._reader is not None

    def start(self) -> None:
        """Start sampling. Called again while running, or after no reader could be opened (logged once,
        with the reason, in :attr:`reason`), it does nothing."""
        if self.interval_s <= 0 or self._thread is not None or self._gave_up:
            return
        if self._factory is not None:
            self._reader = self._factory()
        else:
            index = local_nvml_index() if self.devices is None else None
            devices = [index] if index is not None else self.devices
            self._reader, self.reason = open_reader(devices)
        if self._reader is None:
            self._gave_up = True
            log.info("GPU monitor off: %s", self.reason)
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rlcore-gpu-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def sample_once(self) -> None:
        """Take one reading of every watched device (the thread calls this)."""
        try:
            samples = self._reader.read()  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - a transient NVML error must not kill training
            log.debug("GPU sample failed: %s", e)
            return
        with self._lock:
            while len(self._util) < len(samples):
                self._util.append([])
                self._mem.append([])
            self._phases.append(self.phase)
            for i, s in enumerate(samples):
                self._util[i].append(s.util)
                self._mem[i].append(s.mem_used_gb)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))
            self._thread = None
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()

    def set_phase(self, name: str) -> None:
        """Tag the readings from now on with ``name``: the trainer's ``generate`` or ``train`` inside
        a step, :data:`OUTSIDE` between steps (left out of the health summary)."""
        self.phase = str(name)

    def _summary(self, start: int) -> dict[str, float]:
        with self._lock:
            phases = self._phases[start:]
            util = [u for dev in self._util for u in dev[start:]]
            mem = [m for dev in self._mem for m in dev[start:]]
            # reading k of every device was taken in phase k (devices pooled one after another)
            tags = [p for dev in self._util for p in phases[:max(0, len(dev) - start)]]
            per_phase: dict[str, list[list[float]]] = {}
            for k, phase in enumerate(phases, start):
                per_phase.setdefault(phase, []).append([dev[k] for dev in self._util if k < len(dev)])
        out = summarize(util, mem, self.interval_s, tags)
        if out:
            out.update(phase_summary(per_phase))
            out["gpu/outside_s"] = phases.count(OUTSIDE) * self.interval_s
        return out

    def summary(self) -> dict[str, float]:
        """Summary over the whole run (every watched device pooled); {} when unavailable. The health
        keys cover the readings inside steps; without any, only ``gpu/mem_used_gb_max`` and the
        outside readings' ``gpu/util_mean_outside`` and ``gpu/outside_s`` (see :func:`summarize`)."""
        return self._summary(0) if self.available else {}

    def interval_summary(self) -> dict[str, float]:
        """Summary of the samples since the previous call (for per-logged-step metrics)."""
        if not self.available:
            return {}
        with self._lock:
            start, self._mark = self._mark, max((len(d) for d in self._util), default=0)
        return self._summary(start)


def format_sample_line(names: Sequence[str], samples: Sequence[Sample], elapsed_s: float) -> str:
    parts = [f"gpu{i} {s.util:3.0f}% {s.mem_used_gb:6.1f}/{s.mem_total_gb:.0f} GB" for i, s in enumerate(samples)]
    return f"{elapsed_s:7.1f}s  " + "  |  ".join(parts)


def run_monitor(interval_s: float, count: int, printer: Callable[[str], None] = print,
                reader: Optional[object] = None) -> int:
    """``rlcore monitor``: print a line per sample and a health summary; 0 when no GPU is present."""
    reason = ""
    if reader is None:
        reader, reason = open_reader()
    if reader is None:
        printer(f"no GPU to monitor: {reason}")
        return 0
    names = getattr(reader, "names", [])
    if names:
        printer("watching " + ", ".join(f"gpu{i}={n}" for i, n in enumerate(names)))
    util: list[float] = []
    mem: list[float] = []
    t0, n = time.monotonic(), 0
    try:
        while count <= 0 or n < count:
            samples = reader.read()  # type: ignore[attr-defined]
            util += [s.util for s in samples]
            mem += [s.mem_used_gb for s in samples]
            printer(format_sample_line(names, samples, time.monotonic() - t0))
            n += 1
            if count <= 0 or n < count:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    finally:
        getattr(reader, "close", lambda: None)()
    s = summarize(util, mem, interval_s)
    if s:
        verdict = "healthy" if s["gpu/healthy"] else "below the 85-95% band or dipping under 70%"
        printer(f"mean {s['gpu/util_mean']:.1f}%  p10 {s['gpu/util_p10']:.1f}%  "
                f"max memory {s['gpu/mem_used_gb_max']:.1f} GB  -> {verdict}")
    return 0
