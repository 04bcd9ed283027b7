"""The step's throughput, MFU and memory metrics (``perf/*``, ``memory/*``)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.profiler import record_function

from rlcore.observe import peak


class StepPerf:
    """Per-step ``perf/tokens_per_s``, ``perf/tokens_per_s_per_gpu``, ``perf/mfu`` (:mod:`rlcore.observe.flops`)
    and, on CUDA, ``memory/peak_gb`` and ``memory/alloc_retries``: the allocations of the step that found
    no free block and retried after emptying the allocator's cache (each waits for the device; a step at
    the edge of the card's memory shows them as idle time)."""

    def __init__(self, model_config: Any, device: torch.device, world_size: int):
        self.model_config, self.device, self.world_size = model_config, torch.device(device), int(world_size)
        self.retries_seen = self.retries()

    def retries(self) -> int:
        """The allocator's cache flushes so far on this device (0 off CUDA)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def metrics(self, prompt_mask: torch.Tensor, response_mask: torch.Tensor, step_s: float) -> dict[str, float]:
        tokens = float(prompt_mask.sum() + response_mask.sum())
        out = {"perf/tokens_per_s": tokens * self.world_size / step_s, "perf/tokens_per_s_per_gpu": tokens / step_s}
        try:
            from rlcore.observe.flops import estimate_flops, peak_flops

            device_peak = peak_flops(self.device)
            if device_peak:
                seq = prompt_mask.shape[1] + response_mask.shape[1]
                out["perf/mfu"] = estimate_flops(self.model_config, tokens, seq) / step_s / device_peak
        except (ImportError, ValueError):  # a config whose sizes cannot be read: no MFU, as on an unknown device
            pass
        if self.device.type == "cuda":
            out["memory/peak_gb"] = peak.max_allocated(self.device) / 2**30
            retries = self.retries()
            out["memory/alloc_retries"] = float(retries - self.retries_seen)
            self.retries_seen = retries
        return out


class PhaseClock:
    """The seconds (``time/<name>_s``) and the allocator's cache flushes (``memory/alloc_retries_<name>``,
    where non-zero) of each named phase of a step, each phase marked ``rlcore.<name>`` in profiles."""

    def __init__(self, perf: StepPerf):
        self.perf = perf
        self.reset()

    def reset(self) -> None:
        """Start a new step."""
        self.seconds: dict[str, float] = {}
        self.flushes: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str, timed: bool = True) -> Iterator[None]:
        """Count what happens inside as phase ``name``; ``timed=False``: its flushes only (a phase whose
        seconds are reported elsewhere)."""
        t, before = time.perf_counter(), self.perf.retries()
        try:
            with record_function(f"rlcore.{name}"):
                yield
        finally:
            if timed:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            self.flushes[name] = self.flushes.get(name, 0) + self.perf.retries() - before

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out.update({f"memory/alloc_retries_{k}": float(v) for k, v in self.flushes.items() if v})
        return out
