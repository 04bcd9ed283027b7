"""How much ``torch.compile`` compiled, and for how long: a reading taken before and after a piece
of work (the update) says whether it recompiled inside it, the first suspect when the GPU idles
there (compilation runs on the host while the device waits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompileReading:
    """Frames compiled so far and the seconds spent compiling them (both 0 where torch does not say)."""

    frames: float
    seconds: float

    def since(self, earlier: "CompileReading", scope: str) -> dict[str, float]:
        """``<scope>/compiled_frames`` and ``time/<scope>_compile_s`` between ``earlier`` and this reading."""
        return {f"{scope}/compiled_frames": self.frames - earlier.frames,
                f"time/{scope}_compile_s": self.seconds - earlier.seconds}


def reading() -> CompileReading:
    """The process's compile counters now (dynamo's own counters; zeros where they are missing)."""
    try:
        from torch._dynamo import utils
    except ImportError:  # a build without dynamo
        return CompileReading(0.0, 0.0)
    frames = float(getattr(utils, "counters", {}).get("frames", {}).get("ok", 0))
    times = getattr(utils, "compilation_time_metrics", {}) or {}
    seconds = float(sum(times.get("_compile.compile_inner", []) or []))
    return CompileReading(frames, seconds)
