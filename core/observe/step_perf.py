"""The step's throughput, MFU and memory metrics (``perf/*``, ``memory/*``)."""

from __future__ import annotations

from typing import Any

import torch

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
