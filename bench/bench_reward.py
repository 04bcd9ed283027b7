"""Reward-model placement benchmark: GPU memory, rollout batch and step time of a resident, swapped or CPU reward model.

Setup: a random-init reward model of Qwen2-1.5B shape (Qwen2ForSequenceClassification, num_labels=1) next to a
random-init Qwen2-0.5B actor, both bf16. For each placement of the reward model it reports

* the GPU memory the reward model keeps while the actor generates (resident: its weights; swapped, CPU: none),
* the largest rollout batch that fits: measured generation memory per sample (slope of the peak memory of
  ``generate`` between two batch sizes) into the memory the actor's training state and the reward model leave,
  then, on an emulated smaller GPU, the largest batch that really runs ``generate`` (bisection below the
  prediction),
* the time scoring adds to a step (a rollout of ``--score-batch`` sequences).

Run (GPU):  python bench/bench_reward.py --out results.json
Smoke test: python bench/bench_reward.py --tiny        (CPU, tiny shapes; the numbers mean nothing)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1024 ** 3

ACTOR_0_5B = dict(vocab_size=151936, hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864)
RM_1_5B = dict(vocab_size=151936, hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960)
TINY_ACTOR = dict(vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128)
TINY_RM = dict(vocab_size=512, hidden_size=96, layers=3, heads=4, kv_heads=2, intermediate_size=192)


def import_rlcore() -> None:
    """Make ``rlcore`` importable from a source checkout that is not installed (``core/`` is ``rlcore``)."""
    try:
        import rlcore  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util

    for name, folder in (("rlcore", "core"), ("rlcore.plugins", "plugins")):
        path = os.path.join(ROOT, folder)
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build(kind: str, shape: dict, device: torch.device) -> torch.nn.Module:
    """A random-init bf16 causal LM (``actor``) or reward model (``rm``) built directly on ``device``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

    from rlcore.rewards.tiny import reward_model_config

    if kind == "rm":
        config = reward_model_config("qwen2", vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                                     layers=shape["layers"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                                     intermediate_size=shape["intermediate_size"])
        cls = AutoModelForSequenceClassification
    else:
        config = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                             num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                             num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate_size"],
                             tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
        cls = AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls.from_config(config)
    return model.to(torch.bfloat16).eval()


def actor_training_state(actor: torch.nn.Module) -> Any:
    """Gradients and AdamW moments of the actor, as in training (kept alive by the caller)."""
    for p in actor.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    opt.step()
    return opt


def generation_peak(actor: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int,
                    device: torch.device) -> tuple[int, float]:
    """Peak memory above the resting state while generating ``batch`` full-length samples, and the time."""
    ids = torch.randint(2, actor.config.vocab_size, (batch, prompt_len), device=device)
    reset_peak(device)
    rest = allocated(device)
    t = time.perf_counter()
    with torch.inference_mode():
        actor.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    sync(device)
    return peak(device) - rest, time.perf_counter() - t


def fits(actor: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, device: torch.device) -> bool:
    try:
        generation_peak(actor, batch, prompt_len, new_tokens, device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def largest_fitting(actor: torch.nn.Module, predicted: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Largest batch that really generates, by bisection below ``predicted`` (to ``--bisect-tol``).

    Returns ``{"batch", "tries"}``; ``batch`` is 0 when not even a sixteenth of the prediction fits, and
    ``predicted`` (with ``"at_least": True``) when the prediction itself runs."""
    if fits(actor, predicted, args.prompt_len, args.new_tokens, device):
        return {"batch": predicted, "tries": 1, "at_least": True}
    lo, tries = max(1, predicted // 2), 0
    while lo > max(1, predicted // 16) and not fits(actor, lo, args.prompt_len, args.new_tokens, device):
        lo, tries = lo // 2, tries + 1
    if not fits(actor, lo, args.prompt_len, args.new_tokens, device):
        return {"batch": 0, "tries": tries + 1}
    hi = predicted + 1  # first size known (or assumed) not to fit
    while hi - lo > max(1, int(args.bisect_tol * predicted)):
        mid = (lo + hi) // 2
        tries += 1
        if fits(actor, mid, args.prompt_len, args.new_tokens, device):
            lo = mid
        else:
            hi = mid
    return {"batch": lo, "tries": tries}


def rollout_batch(rm_shape: dict, n: int, prompt_len: int, response_len: int) -> Any:
    from rlcore.protocols import RewardInput

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, rm_shape["vocab_size"], (n, prompt_len), generator=g).tolist()
    responses = torch.randint(2, rm_shape["vocab_size"], (n, response_len), generator=g).tolist()
    return RewardInput(prompts=[""] * n, responses=[""] * n, prompt_ids=prompts, response_ids=responses)


def timed(fn: Any, device: torch.device, repeat: int = 3) -> float:
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure_scoring(args: argparse.Namespace, device: torch.device, rm_shape: dict, out: dict) -> None:
    """Memory and time of the three placements of the reward model."""
    from rlcore.plugins.rm_offload import SwappedScorer
    from rlcore.protocols import RewardInput
    from rlcore.rewards.reward_model import ResidentScorer, RewardModel

    batch = rollout_batch(rm_shape, args.score_batch, args.prompt_len, args.new_tokens)
    reset_peak(device)
    before = allocated(device)
    rm = RewardModel(build("rm", rm_shape, device), None, None, max_length=4096, micro_batch_size=args.rm_micro_batch)
    sync(device)
    out["rm_params_b"] = sum(p.numel() for p in rm.module.parameters()) / 1e9
    out["rm_resident_gb"] = (allocated(device) - before) / GB
    resident = ResidentScorer(rm, device)
    small = rollout_batch(rm_shape, max(args.cpu_samples, 4), args.prompt_len, args.new_tokens)
    ref = torch.tensor(resident(small).scores)
    reset_peak(device)
    rest = allocated(device)
    out["resident_score_s"] = timed(lambda: resident(batch), device)
    out["rm_scoring_extra_gb"] = (peak(device) - rest) / GB  # activations while scoring, above the weights

    swapped = SwappedScorer(rm, device)  # moves the weights home (pinned when on a GPU)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["rm_offloaded_resting_gb"] = (allocated(device) - before) / GB

    def copy_only() -> None:
        with swapped.on_device():
            sync(device)

    out["swap_copy_s"] = timed(copy_only, device)
    reset_peak(device)
    rest = allocated(device)
    out["swapped_score_s"] = timed(lambda: swapped(batch), device)
    out["swapped_scoring_peak_gb"] = (peak(device) - rest) / GB
    out["copy_gb_per_s"] = out["rm_resident_gb"] / out["swap_copy_s"] if out["swap_copy_s"] > 0 else 0.0

    out["max_abs_diff_swapped"] = float((torch.tensor(swapped(small).scores) - ref).abs().max())
    cpu = ResidentScorer(rm, torch.device("cpu"))  # the weights already rest on the CPU
    k = args.cpu_samples  # the first samples of ``small``, so that the scores compare like with like
    few = RewardInput(prompts=small.prompts[:k], responses=small.responses[:k], prompt_ids=small.prompt_ids[:k],
                      response_ids=small.response_ids[:k])
    t = time.perf_counter()
    cpu_scores = torch.tensor(cpu(few).scores)
    out["cpu_score_s_per_sample"] = (time.perf_counter() - t) / args.cpu_samples
    out["max_abs_diff_cpu"] = float((cpu_scores - ref[:k]).abs().max())
    out["score_scale"] = float(ref.abs().mean())
    out["cpu_score_s"] = out["cpu_score_s_per_sample"] * args.score_batch
    resident = swapped = cpu = rm = None  # free the GPU memory (the closures above refer to them)
    gc.collect()


def largest_batches(out: dict, gpu_gb: float, margin_gb: float) -> dict:
    """Largest rollout batch per placement on a GPU of ``gpu_gb``, from the measured memory per sample."""
    free = gpu_gb - margin_gb - out["actor_state_gb"]
    keep = {"resident": out["rm_resident_gb"], "offloaded": out["rm_offloaded_resting_gb"], "cpu": 0.0}
    return {mode: max(0, int((free - gb) / out["gen_gb_per_sample"])) for mode, gb in keep.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--score-batch", type=int, default=256, help="rollout sequences scored per step")
    p.add_argument("--rm-micro-batch", type=int, default=32)
    p.add_argument("--cpu-samples", type=int, default=1, help="sequences timed on the CPU (then extrapolated)")
    p.add_argument("--gen-batches", type=int, nargs=2, default=(32, 128), help="batches whose peaks give the slope")
    p.add_argument("--emulate-gb", type=float, default=24.0, help="GPU size on which the batch is checked by running")
    p.add_argument("--margin-gb", type=float, default=1.0, help="memory kept free for fragmentation")
    p.add_argument("--bisect-tol", type=float, default=0.03,
                   help="stop bisecting for the largest batch that runs when the bracket is this share of the prediction")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    import_rlcore()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda", 0)
    if args.tiny:
        args.prompt_len, args.new_tokens, args.score_batch, args.gen_batches = 8, 8, 8, (2, 4)
    actor_shape, rm_shape = (TINY_ACTOR, TINY_RM) if args.tiny else (ACTOR_0_5B, RM_1_5B)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "score_batch": args.score_batch}
    import transformers

    out["transformers"] = transformers.__version__
    if device.type == "cuda":
        out["gpu_gb"] = torch.cuda.get_device_properties(0).total_memory / GB

    # 1. The actor: weights plus training state, then generation memory per sample.
    actor = build("actor", actor_shape, device)
    opt = actor_training_state(actor)
    sync(device)
    out["actor_state_gb"] = allocated(device) / GB
    (b1, b2) = args.gen_batches
    (m1, t1), (m2, t2) = (generation_peak(actor, b, args.prompt_len, args.new_tokens, device) for b in (b1, b2))
    out["gen_gb_per_sample"] = max((m2 - m1) / (b2 - b1) / GB, 1e-9)
    out["gen_s"] = {str(b1): t1, str(b2): t2}
    dump(out, args.out)

    # 2. The reward model in each placement.
    measure_scoring(args, device, rm_shape, out)
    dump(out, args.out)

    # 3. Largest rollout batch: on this GPU (computed) and on an emulated smaller one (computed, then run).
    if device.type == "cuda":
        out["batch_this_gpu"] = largest_batches(out, out["gpu_gb"], args.margin_gb)
        out["batch_emulated"] = largest_batches(out, args.emulate_gb, args.margin_gb)
        torch.cuda.set_per_process_memory_fraction(args.emulate_gb / out["gpu_gb"], 0)
        checked = {}
        for mode in ("resident", "offloaded"):
            hold = torch.empty(int(out["rm_resident_gb"] * GB) if mode == "resident" else 0, dtype=torch.uint8,
                               device=device)  # the resident weights' footprint
            checked[mode] = largest_fitting(actor, out["batch_emulated"][mode], args, device)
            del hold
        out["batch_emulated_checked"] = checked
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    del opt, actor
    dump(out, args.out)
    return out


def dump(out: dict, path: str | None) -> None:
    """Print the results so far (and write them to ``path``): a run cut short still leaves its numbers."""
    print(json.dumps(out, indent=2), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
