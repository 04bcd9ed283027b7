"""Helpers shared by the benchmark scripts: importing rlcore from a checkout, device ceilings, timing."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_rlcore() -> None:
    """Make ``rlcore`` importable from a source checkout that is not installed (``core/`` is ``rlcore``)."""
    try:
        import rlcore  # noqa: F401
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("rlcore", os.path.join(ROOT, "core", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(ROOT, "core")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlcore"] = module
    spec.loader.exec_module(module)


def environment() -> dict[str, Any]:
    """Versions, device and commit, for the results file."""
    import transformers

    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
                            "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count)
    if os.environ.get("RLCORE_BENCH_COMMIT"):  # a copied tree whose .git may lag behind its files
        info["commit"] = os.environ["RLCORE_BENCH_COMMIT"]
        return info
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of ``fn()`` with device synchronisation on both sides."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def cuda_ms(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn: Callable[[], Any], repeats: int = 20, replays: int = 1, warmup: int = 2) -> float:
    """Median device milliseconds of one replay of a CUDA graph of ``fn``.

    ``fn`` runs ``warmup`` times on a side stream first (compilation, library handles), is captured,
    replayed 3 times, then timed ``repeats`` times over ``replays`` back-to-back replays each."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device copy (median of timed copies)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms / 1e3)


def device_ceilings() -> dict[str, float]:
    """Measured copy bandwidth (bytes read + written per second) and dense bf16 matmul rate."""
    bandwidth = copy_bandwidth()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b)
    flops = 2 * 8192**3 / (ms / 1e3)
    a = b = None  # free the inputs (the lambda above still refers to them)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bandwidth, "bf16_matmul_flops": flops}


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)


def run_train_steps(trainer, count: int, before_step: Callable[[int], None] | None = None,
                    label: str = "rlcore") -> tuple[list[float], list[dict[str, float]]]:
    """Steps ``1..count`` of an rlcore ``Trainer`` with its GPU monitor on; ``(seconds of each step,
    its numeric metrics)``, the device synchronised around each step. ``before_step(step)`` runs first."""
    from omegaconf import OmegaConf

    times: list[float] = []
    steps: list[dict[str, float]] = []
    # the lifecycle hooks around the steps, as Trainer.train calls them: the gpu-monitor plugin samples between them
    trainer.hook.rlcore_train_start(run_dir=str(trainer.cfg.trainer.output_dir), dist=trainer.dist,
                                    config=OmegaConf.to_container(trainer.cfg, resolve=True))
    status = "failed"
    try:
        for step in range(1, count + 1):
            if before_step is not None:
                before_step(step)
            seconds, metrics = timed(lambda: trainer.train_step(step))
            times.append(seconds)
            steps.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
            print(f"  {label} step {step}: {seconds:.3f} s  " + "  ".join(
                f"{k[5:-2]}={v:.3f}" for k, v in metrics.items() if k.startswith("time/"))
                + (f"  grad_norm={float(metrics['actor/grad_norm']):.4g}" if "actor/grad_norm" in metrics
                   else "  no update")
                + f"  skipped={int(metrics.get('train/nonfinite_steps', 0))}", flush=True)
        status = "completed"
    finally:
        trainer.hook.rlcore_train_end(step=len(times), status=status, summary={})
    return times, steps
