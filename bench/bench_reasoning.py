"""Reasoning workload: one GRPO step of rlcore's ``Trainer`` against TRL's ``GRPOTrainer``, long
variable-length responses, same model, prompts, stop rule and reward.

Workload (``--preset full``): 32 prompts x 8 samples a step; prompts of 64-512 random tokens
(uniform lengths); temperature-1 sampling; responses end at the first of a set of ``k`` stop tokens
or at the cap of 8192 tokens; the reward is a hash of the response text in ``[0, 1)``, so it varies
between samples and GRPO's advantages are not zero; bf16, AdamW (lr 1e-6, grad-norm clip 1.0), no KL
term, one optimizer step per rollout.

Lengths: a random-init model's next-token distribution is close to uniform, so each step ends a
response with probability about ``k / V`` (V the vocabulary), a geometric length distribution cut
at the cap (long-tailed: the longest of 256 samples runs to about ``mean x ln 256``). ``k`` is chosen
so that the capped geometric mean is ``--mean-len`` (1500 tokens): ``E[min(G, cap)] = (1 - (1 -
p)^cap) / p`` with ``p = k / V``. The stop ids are token ``t0`` (the tokenizer's EOS and pad token)
plus ``k - 1`` random others, saved as the model's ``generation_config.eos_token_id``: TRL stops
and masks on that list, rlcore's trainer is given the same list. The realised lengths of every
system are measured and reported (a random model is not exactly uniform).

Model directory per shape: random weights saved with ``save_pretrained`` and a word-level
tokenizer ``t0 .. t{V-1}`` (no download), read by both systems.

Per system and shape the result has: seconds per step and its parts (rollout, scoring, log-probs,
update, other), tokens/s (prompt + response tokens of the step), the response length distribution,
the update's MFU (model FLOPs of a forward and backward pass over the step's sequences, as
``rlcore.observe.flops`` counts them, over the update's time and the device's bf16 peak; with
``--rlcore-override ppo.overlap_update=true`` the update part is the time after the rollout, the
share of the samples trained on during the rollout is ``update_overlapped_frac``, and the MFU counts
the update's forward and backward time during the rollout too: :func:`update_compute_s`), the GPU
monitor's mean and p10 utilisation over the measured steps (``rlcore.observe.gpu``), and for rlcore
the numerics: the rollout's log-probs against the trainer's recomputation (mean/max absolute
difference, KL estimates), for rlcore's rollout backend and for HF ``generate`` on the same
trainer, on ``--numerics-prompts`` prompts x n samples of at most ``--numerics-cap`` tokens.

``--fixed-lengths`` (rlcore only): the lengths are drawn up front from the same capped geometric
distribution, one stream per rollout call of a run, and given to the engine as per-prompt token
limits with no stop token, so that runs of different settings decode the same lengths (the longest
response, whose sequential decode steps set the rollout's time, among them) and their step times
compare side by side; without it each run draws its lengths anew through the sampled tokens. With
partial rollouts a carried sample keeps its own drawn length across steps.

Warm-up: ``--warmup`` steps (default 1) with responses cut at ``--warmup-cap`` tokens (compilation of
the engine's step and the training layers), then on CUDA the engine captures the decode graphs of
every batch and length bucket (``RolloutEngine.warmup``, timed as ``engine_warmup_s``), so that the
measured steps hold no one-time cost. Where the checkout has them, rlcore runs with token-budget
micro-batches and checkpointing chosen by memory (``ppo.max_tokens_per_micro_batch``,
``actor.gradient_checkpointing=auto``) and a paged KV cache (all 256 samples admitted at once).

Robustness (one GPU call should return as much as it can): every (shape, system) runs in its own
subprocess; out of memory moves to the next, smaller setting of that system's ladder (rlcore:
gradient checkpointing, then half the engine slots and micro-batch; TRL: half the micro-batch, then
half the generation batch), and the setting that ran is reported; the whole call has a time budget
(``--total-budget-s``, 540 s by default: one device command runs at most 600 s), shared equally by
the shapes (``--budget-s`` caps a shape's share), and each system a timeout; a run cut by either
is reported with what it had done
(TRL: decode steps and time inside ``generate``, a lower bound of its step and an extrapolation,
labelled as such); results are written to ``--out`` after every run (``--resume`` keeps the finished
ones of an earlier call), and when the driver is sent SIGTERM (an outer ``timeout``): the running worker
is stopped and recorded as a timed-out one is, and nothing else starts.

Systems: ``rlcore`` (the default rollout backend: the engine where it supports the model), ``trl``
(HF ``generate``, gradient checkpointing on: TRL's default), ``trl-cb`` (TRL with transformers'
continuous batching, ``use_transformers_continuous_batching``).

Run (GPU):    python bench/bench_reasoning.py --shapes qwen2.5-1.5b --out $OUT/reasoning.json
Smoke (CPU):  python bench/bench_reasoning.py --smoke --out /tmp/reasoning.json   (numbers mean nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("rlcore", "trl", "trl-cb")
DEFAULT_SYSTEMS = ("rlcore", "trl")
DEFAULT_SHAPES = ("qwen2.5-1.5b", "qwen3-1.7b", "qwen2.5-7b")
PRESETS = {
    "full": dict(prompts=32, n=8, prompt_min=64, prompt_max=512, mean_len=1500, cap=8192, warmup=1, warmup_cap=1024,
                 steps=1, trl_warmup=0, trl_steps=1, dtype="bf16", numerics_prompts=4, numerics_cap=512,
                 total_budget_s=540, timeout_rlcore=420, timeout_trl=300),
    "smoke": dict(prompts=4, n=4, prompt_min=8, prompt_max=24, mean_len=12, cap=32, warmup=0, warmup_cap=32,
                  steps=1, trl_warmup=0, trl_steps=1, dtype="fp32", numerics_prompts=2, numerics_cap=16,
                  total_budget_s=900, timeout_rlcore=300, timeout_trl=300),
}
SMOKE_SHAPES = ("tiny-qwen3",)
#: the first setting of each system's ladder: rlcore's engine slots (``ppo.generation.batch_size``; with
#: the static KV cache it holds slots x (prompt_max + cap) tokens, a paged cache takes all 256 samples),
#: micro-batch, and token budget of a micro-batch where the trainer has ``ppo.max_tokens_per_micro_batch``;
#: TRL's micro-batch (its generation batch is sized from memory, see :func:`trl_generation_batch`)
SHAPE_SETTINGS = {
    "qwen2.5-1.5b": dict(slots=256, micro=4, tokens=32768, trl_micro=4),
    "qwen3-1.7b": dict(slots=256, micro=4, tokens=32768, trl_micro=4),
    "qwen2.5-7b": dict(slots=256, micro=2, tokens=16384, trl_micro=2),
    "qwen3-8b": dict(slots=256, micro=2, tokens=16384, trl_micro=2),
    "llama3-8b": dict(slots=256, micro=2, tokens=16384, trl_micro=2),
}
TINY_SETTINGS = dict(slots=16, micro=4, tokens=256, trl_micro=4)
OOM_EXIT = 3
REWARD_SOURCE = '''"""Reward of the reasoning benchmark: a hash of the response text in [0, 1) (it varies between
samples, so GRPO advantages are not zero; the same function scores both systems)."""

import hashlib


def compute_score(responses, **kwargs):
    return [int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") / 2**32 for text in responses]
'''


# ------------------------------------------------------------------------------------------------ workload

def capped_mean(p: float, cap: int) -> float:
    """Mean of ``min(G, cap)`` for ``G`` geometric with success probability ``p`` (support 1, 2, ...)."""
    return (1 - (1 - p) ** cap) / p


def stop_count(vocab: int, mean: float, cap: int) -> int:
    """The number ``k`` of stop tokens whose capped geometric mean length (``p = k / vocab``) is nearest ``mean``."""
    lo, hi = 1, vocab - 1  # capped_mean falls as k grows: the first k at or below the target
    while lo < hi:
        mid = (lo + hi) // 2
        if capped_mean(mid / vocab, cap) > mean:
            lo = mid + 1
        else:
            hi = mid
    return min({max(1, lo - 1), lo}, key=lambda k: abs(capped_mean(k / vocab, cap) - mean))


def stop_ids(vocab: int, k: int, seed: int = 0) -> list[int]:
    """``t0`` (EOS and pad) and ``k - 1`` other random token ids."""
    return [0] + sorted(random.Random(seed).sample(range(1, vocab), k - 1))


def make_prompts(rows: int, low: int, high: int, vocab: int, stops: list[int], seed: int = 0) -> list[list[int]]:
    """``rows`` prompts of uniform random lengths in ``[low, high]``, random tokens other than the stop ids."""
    rng = random.Random(seed)
    allowed = sorted(set(range(1, vocab)) - set(stops))
    return [rng.choices(allowed, k=rng.randint(low, high)) for _ in range(rows)]


def length_stats(lengths: list[int], cap: int) -> dict[str, float]:
    if not lengths:
        return {}
    ordered = sorted(lengths)

    def pct(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "p10": pct(0.1), "p50": pct(0.5),
            "p90": pct(0.9), "p99": pct(0.99), "max": float(ordered[-1]),
            "capped_frac": sum(x >= cap for x in ordered) / len(ordered)}


class ReasoningPrompts:
    """Map-style dataset for rlcore's ``data.custom_cls``: the benchmark's prompts from ``prompts_file``."""

    def __init__(self, data_files: list, prompt_key: str = "prompt", prompts_file: str = ""):
        self.key = prompt_key
        with open(prompts_file) as f:
            self.rows = json.load(f)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.rows[i]
        return {self.key: " ".join(f"t{t}" for t in ids), "input_ids": list(ids)}


def update_flops(config, sequence_lengths: list[int]) -> float:
    """Model FLOPs of a forward and backward pass over sequences of these lengths."""
    from rlcore.observe.flops import estimate_flops

    return sum(estimate_flops(config, length, length) for length in sequence_lengths)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _write(path: str, payload: dict[str, Any]) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)


#: ``parts.other`` over this share of a step gets a note under the table (the timed parts miss work)
UNTIMED_WARN = 0.05


def update_compute_s(mean: dict[str, float]) -> float:
    """Seconds the actor's update computed: after the rollout (``time/update_actor_s``, which includes the
    wait for the overlapped update's last micro-batches) plus, with ``ppo.overlap_update``, the forward and
    backward that ran during the rollout (``time/update_overlap_s``, less the part already counted as
    that wait). Without the overlap: ``time/update_actor_s``."""
    during = max(0.0, mean.get("time/update_overlap_s", 0.0) - mean.get("time/update_overlap_wait_s", 0.0))
    return mean.get("time/update_actor_s", 0.0) + during


def _parts(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s})
    return {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in keys}


# ------------------------------------------------------------------------------------------------ build

def build_shape(spec: dict[str, Any]) -> dict[str, Any]:
    """Random-init model of the shape, the ``t0 .. t{V-1}`` tokenizer, the stop ids, prompts and reward file."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from _models import random_model

    device = "cuda" if torch.cuda.is_available() and spec["device"] == "cuda" else "cpu"
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    model = random_model(spec["shape"], dtype, device, seed=0)
    vocab = model.config.vocab_size
    k = stop_count(vocab, spec["mean_len"], spec["cap"])
    stops = stop_ids(vocab, k)
    model.config.eos_token_id = model.config.pad_token_id = 0
    model.config.bos_token_id = None
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    model.save_pretrained(spec["model_dir"])
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0", unk_token="t0",
                            padding_side="left").save_pretrained(spec["model_dir"])
    rows = spec["prompts"] * (max(spec["warmup"] + spec["steps"], spec["trl_warmup"] + spec["trl_steps"]) + 1)
    prompts = make_prompts(rows, spec["prompt_min"], spec["prompt_max"], vocab, stops)
    with open(spec["prompts_file"], "w") as f:
        json.dump(prompts, f)
    with open(spec["reward_file"], "w") as f:
        f.write(REWARD_SOURCE)
    kv_heads = model.config.num_key_value_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    return {"vocab": vocab, "stop_ids": stops, "stop_count": k,
            "expected_mean_len": capped_mean(k / vocab, spec["cap"]),
            "params": sum(p.numel() for p in model.parameters()),
            "kv_bytes_per_token": 2 * model.config.num_hidden_layers * kv_heads * head_dim * (2 if dtype != torch.float32 else 4)}


def _reward_fn(path: str):
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("reasoning_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.compute_score


# ------------------------------------------------------------------------------------------------ rlcore

def rlcore_features() -> dict[str, bool]:
    """What this checkout's trainer and engine offer: token-budget micro-batches with activation
    checkpointing chosen by memory (``ppo.max_tokens_per_micro_batch``, ``gradient_checkpointing=auto``)
    and a paged KV cache (``actor.rollout_engine.kv_cache``)."""
    import dataclasses

    from _common import import_rlcore

    import_rlcore()
    from rlcore.config.schema import PPOConfig, RolloutEngineConfig

    return {"token_budget": "max_tokens_per_micro_batch" in {f.name for f in dataclasses.fields(PPOConfig)},
            "paged_kv": "kv_cache" in {f.name for f in dataclasses.fields(RolloutEngineConfig)}}


def rlcore_overrides(spec: dict[str, Any], setting: dict[str, Any]) -> list[str]:
    extra = [f"ppo.max_tokens_per_micro_batch={setting['tokens']}"] if setting.get("tokens") else []
    return [f"actor.model_path={spec['model_dir']}", f"actor.dtype={spec['dtype']}", "actor.lr=1e-6",
            "actor.grad_clip=1.0", f"actor.gradient_checkpointing={str(setting['gc']).lower()}", *extra,
            "algorithm.adv_estimator=grpo", f"ppo.rollout_batch_size={spec['prompts']}",
            f"ppo.generation.n={spec['n']}", f"ppo.generation.max_new_tokens={spec['cap']}",
            f"ppo.generation.batch_size={setting['slots']}", "ppo.generation.temperature=1.0",
            "ppo.generation.top_p=1.0", "ppo.generation.top_k=0", "ppo.kl_coeff=0", "ppo.ppo_epochs=1",
            "ppo.mini_batch_size=0", f"ppo.micro_batch_size={setting['micro']}",
            f"data.max_prompt_length={spec['prompt_max']}", f"data.custom_cls.path={os.path.abspath(__file__)}",
            "data.custom_cls.name=ReasoningPrompts", f"data.custom_cls.kwargs.prompts_file={spec['prompts_file']}",
            f"custom_reward_function.path={spec['reward_file']}", "custom_reward_function.name=compute_score",
            f"trainer.max_steps={spec['warmup'] + spec['steps']}", "trainer.progress=false", "trainer.log_steps=1",
            "trainer.gpu_monitor=true", f"trainer.output_dir={spec['run_dir']}", "trainer.resume=disable",
            "trainer.export_final=false", f"trainer.device={spec['device']}", *spec.get("rlcore_overrides", [])]


def run_rlcore(spec: dict[str, Any], setting: dict[str, Any], progress: dict[str, Any]) -> dict[str, Any]:
    import torch

    from _common import import_rlcore, run_train_steps, timed

    import_rlcore()
    from rlcore.config import load_config
    from rlcore.distributed.init import init_distributed
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.trainer.loop import Trainer

    overrides = rlcore_overrides(spec, setting)
    if spec.get("attention_max_chunk") is not None:
        overrides.append(f"actor.rollout_engine.attention_tuning.max_chunk={int(spec['attention_max_chunk'])}")
    cfg = load_config([], overrides)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, build_plugin_manager(list(cfg.plugins)), init_distributed(cfg.trainer.device))
    trainer.c.eos_ids = list(spec["stop_ids"])  # the stop rule (see the module docstring)
    if spec.get("fixed_lengths"):
        fix_lengths(trainer, spec)
    setup_s = time.perf_counter() - t0
    rollouts, trained = _record_runs(trainer, spec)
    total = spec["warmup"] + spec["steps"]
    # --profile-update: one more step, its update under the profiler, left out of the measured figures
    profiling = {"report": None, "kept": None} if spec.get("profile_update") else None
    total += profiling is not None
    engine_warmup_s = None

    def before_step(step: int) -> None:
        nonlocal engine_warmup_s
        backend = _the_backend(trainer)
        if step == spec["warmup"] + 1 and spec["device"] == "cuda" and hasattr(backend, "warmup"):
            # capture the decode graphs of every batch and length bucket before the measured steps
            # (a training run captures them once; the short warm-up steps did not reach every length)
            progress.update(phase="engine warmup")
            spec["_save_progress"]()
            try:
                engine_warmup_s, _ = timed(backend.warmup)
            except Exception as error:  # noqa: BLE001 - the measured step then includes the captures
                engine_warmup_s = f"failed: {type(error).__name__}: {str(error)[:200]}"
                if _is_oom(error):
                    import torch

                    torch.cuda.empty_cache()
        if profiling is not None and step == total:
            profiling["kept"] = (len(rollouts), len(trained))
            _profile_next_update(profiling)
        progress.update(phase="warmup" if step <= spec["warmup"] else "measured", step=step,
                        step_started_at=time.time())
        spec["_save_progress"]()

    times, steps = run_train_steps(trainer, total, before_step)
    if profiling is not None:  # the profiled step's figures are not the measured ones
        times, steps = times[:-1], steps[:-1]
        del rollouts[profiling["kept"][0]:], trained[profiling["kept"][1]:]
    result = _measured(trainer, spec, times, steps, rollouts, trained)
    result.update(setup_s=setup_s, engine_warmup_s=engine_warmup_s)
    if profiling is not None:
        result["update_idle"] = profiling["report"]
    # the measured step stands even if the numerics that follow run past the timeout
    progress.update(phase="numerics", result=result)
    spec["_save_progress"]()
    try:
        result["numerics"] = rlcore_numerics(trainer, spec, setting) if spec["numerics_prompts"] > 0 else {}
    except Exception as error:  # noqa: BLE001 - the step's numbers stand without it
        if _is_oom(error):
            torch.cuda.empty_cache()
        traceback.print_exc()
        result["numerics"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return result


def _record_runs(trainer, spec: dict[str, Any]) -> tuple[list, list]:
    """Wrap ``trainer``'s generation, sample source and sampling settings: returns the lists each step's
    ``(prompt lengths, response lengths)`` go to, of the samples generated and of those trained; the
    warm-up steps' responses are cut at ``spec["warmup_cap"]``."""
    import dataclasses

    rollouts: list[tuple[list[int], list[int]]] = []
    plain_generate = trainer.c.generation.generate

    def recording_generate(prompts, params, *args, **kwargs):
        batch = plain_generate(prompts, params, *args, **kwargs)
        rollouts.append((batch.prompt_mask.sum(-1).tolist(), batch.response_mask.sum(-1).tolist()))
        return batch

    trainer.c.generation.generate = recording_generate
    # the samples each step trains (with ppo.partial_rollout some were generated at earlier steps, and
    # a step's rollout also decodes samples trained later): the update's FLOPs count these
    trained: list[tuple[list[int], list[int]]] = []
    plain_next = trainer.source.next

    def recording_next(step: int):
        sampled = plain_next(step)
        r = sampled.rollout
        trained.append((r.prompt_mask.sum(-1).tolist(), r.response_mask.sum(-1).tolist()))
        return sampled

    trainer.source.next = recording_next
    plain_sampling = trainer.sampling

    def sampling(step: int, *args, **kwargs):
        # warm-up steps (compilation, graph capture) with responses cut at warmup_cap
        params = plain_sampling(step, *args, **kwargs)
        if step <= spec["warmup"]:
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, spec["warmup_cap"]))
        return params

    trainer.sampling = sampling
    return rollouts, trained


def _measured(trainer, spec: dict[str, Any], times: list[float], steps: list[dict[str, float]], rollouts: list,
              trained: list) -> dict[str, Any]:
    """The result of the measured steps (those after ``spec["warmup"]``, or the last one): seconds a step and
    its parts, lengths, samples a second, the update's MFU, the GPU monitor's and the trainer's metrics."""
    from rlcore.observe.flops import peak_flops

    first = spec["warmup"]
    measured = steps[first:] or steps[-1:]
    lengths = [x for _, resp in trained[first:] or trained[-1:] for x in resp]
    sequences = [p + r for prompt, resp in trained[first:] or trained[-1:] for p, r in zip(prompt, resp)]
    decoded = [sum(resp) for _, resp in rollouts[first:] or rollouts[-1:]]
    mean = _parts(measured)
    step_s = sum(times[first:] or times[-1:]) / len(times[first:] or times[-1:])
    parts = {"rollout": mean.get("time/generate_s", 0.0), "scoring": mean.get("time/reward_s", 0.0),
             "logprobs": mean.get("time/old_logprob_s", 0.0) + mean.get("time/ref_logprob_s", 0.0),
             "update": mean.get("time/update_actor_s", 0.0)}
    parts["other"] = step_s - sum(parts.values())
    peak = peak_flops(trainer.c.train_device)
    steps_measured = max(1, len(times[first:]))
    flops = update_flops(trainer.c.policy.config, sequences) / steps_measured
    result = {"step_s": step_s, "step_times": times, "parts": parts,
              "tokens_per_step": sum(sequences) / steps_measured, "lengths": length_stats(lengths, spec["cap"]),
              "samples_trained": [len(resp) for _, resp in trained], "tokens_decoded": decoded,
              # what partial rollouts compare by: the samples a measured step trains vary, so samples a second
              "samples_per_s": (sum(len(resp) for _, resp in trained[first:] or trained[-1:])
                                / max(sum(times[first:] or times[-1:]), 1e-9)),
              "update_mfu": flops / update_compute_s(mean) / peak if peak and update_compute_s(mean) > 0 else None,
              "update_overlapped_frac": mean.get("update/overlapped_frac"),
              # optimizer steps skipped for a non-finite loss or gradient norm, warm-up steps included
              "nonfinite_steps": [float(m.get("train/nonfinite_steps", 0.0)) for m in steps],
              # None: the step ran no update (a partial rollout's step whose groups are all still waiting)
              "grad_norms": [float(m["actor/grad_norm"]) if "actor/grad_norm" in m else None for m in steps],
              "gpu": {k: v for k, v in mean.items() if k.startswith("gpu/")},
              "metrics": {k: v for k, v in mean.items() if k.startswith(("time/", "perf/", "memory/", "response/",
                                                                            "reward/", "mismatch", "rollout",
                                                                            "update/", "train/", "partial/",
                                                                            "actor/"))},
              "step_metrics": [{k: v for k, v in m.items() if k.startswith(("partial/", "gpu/util", "time/"))}
                               for m in steps],
              "rollout_backend": _backend_name(trainer),
              "engine_settings": _engine_settings(trainer)}
    result["tokens_per_s"] = result["tokens_per_step"] / step_s
    return result


def _profile_next_update(sink: dict[str, Any]) -> None:
    """Run the trainer's next update under ``torch.profiler`` (once): the device's busy share of it and
    its idle stretches by the host op running in them (``rlcore.observe.profile_report.idle_gaps``) go
    to ``sink["report"]``, the update's largest kernels to the log."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import rlcore.trainer.loop as loop
    from rlcore.observe.profile_report import busy_share, format_gaps, idle_gaps, load_events, summarize_gaps

    plain = loop.ppo_update

    def profiled(*args, **kwargs):
        loop.ppo_update = plain
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            with record_function("bench.update"):  # the window ends when the device has finished the update
                out = plain(*args, **kwargs)
                _sync()
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(os.path.join(tmp, "update.json"))
            events = load_events(os.path.join(tmp, "update.json"))
        gaps, ranges = idle_gaps(events, window_name="bench.update")
        if ranges:
            sink["report"] = dict(summarize_gaps(gaps, ranges), busy_frac=busy_share(events, ranges))
            print(f"== the update under the profiler: device busy {100 * sink['report']['busy_frac']:.1f}% of "
                  f"{sink['report']['window_s']:.2f} s\n" + "\n".join(format_gaps(gaps, ranges, 12)), flush=True)
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70), flush=True)
        return out

    loop.ppo_update = profiled


def geometric_lengths(count: int, p: float, cap: int, seed: str) -> list[int]:
    """``count`` lengths drawn from the geometric distribution of success probability ``p`` (support
    1, 2, ...), cut at ``cap``: the stop rule's lengths, drawn up front from a stream named by ``seed``."""
    import math
    import random

    rng = random.Random(seed)
    log_q = math.log1p(-p)
    return [min(cap, max(1, math.ceil(math.log1p(-rng.random()) / log_q))) for _ in range(count)]


def fix_lengths(trainer, spec: dict[str, Any]) -> None:
    """``--fixed-lengths``: every rollout call's new responses get lengths drawn up front from the stop
    rule's distribution (:func:`geometric_lengths`, ``p = k / V``; the n-th call of a run draws from the
    n-th stream), given to the engine as per-prompt ``max_new_tokens``, with no stop token, so that runs
    of different settings decode the same lengths and their step times compare.

    With partial rollouts a sample the call leaves unfinished (cut by ``tail_rows``, or stopped at its
    segment) keeps its own drawn length: its next call's prompt (its prompt and its tokens so far) is
    looked up and given the rest of it (at least one token); the caller's own limit (its budget left)
    holds too."""
    from rlcore.rollout.engine import RolloutEngine

    p = len(spec["stop_ids"]) / int(trainer.c.policy.config.vocab_size)
    trainer.c.eos_ids = []
    plain = RolloutEngine.generate
    calls = [0]
    rest: dict[tuple[int, ...], int] = {}  # an unfinished sample's prompt + tokens -> its drawn tokens still to come

    def generate(self, prompts, params, on_finished=None, max_new_tokens=None):
        calls[0] += 1
        keys = [tuple(int(t) for t in prompt) for prompt in prompts]
        new = [k not in rest for k in keys]
        drawn = iter(geometric_lengths(sum(new), p, params.max_new_tokens, f"fixed-{calls[0]}"))
        wanted = [next(drawn) if fresh else max(1, rest.pop(key)) for key, fresh in zip(keys, new)]
        limits = wanted if max_new_tokens is None else [min(w, int(m)) for w, m in zip(wanted, max_new_tokens)]
        batch = plain(self, prompts, params, on_finished, limits)
        got = batch.response_mask.sum(-1).tolist()
        ids = batch.response_ids.tolist()
        for key, want, n, row in zip(keys, wanted, got, ids):
            if n < want:  # unfinished: the rest of its length is due at the next call
                rest[key + tuple(row[:n])] = want - n
        return batch

    RolloutEngine.generate = generate  # this worker process runs one system's run


def _the_backend(trainer):
    """The rollout backend the trainer built (one process: one), without refreshing it."""
    return next(iter(trainer.c.generation.backends.values()), None)


def _backend_name(trainer) -> str | None:
    backend = _the_backend(trainer)
    return None if backend is None else type(backend).__name__


def _engine_settings(trainer) -> dict[str, Any]:
    """The engine's resolved settings (attention kind, compilation, cache), for the record."""
    backend = _the_backend(trainer)
    keys = ("attention", "compile", "use_cuda_graphs", "rope_in_attention", "max_batch_size", "max_seq_len",
            "kv_cache", "page_size", "kv_bytes")
    return {key: getattr(backend, key) for key in keys if isinstance(getattr(backend, key, None), (str, int, bool))}


def rlcore_numerics(trainer, spec: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """The rollout's log-probs against the trainer's recomputation, for rlcore's rollout backend
    and for HF ``generate`` over the same model, on the same prompts."""
    import torch

    from _models import mismatch
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.hf import HFGenerateBackend
    from rlcore.trainer.experience import batched_logprobs

    with open(spec["prompts_file"]) as f:
        pool = json.load(f)
    prompts = [p for p in pool[:spec["numerics_prompts"]] for _ in range(spec["n"])]
    params = SamplingParams(max_new_tokens=spec["numerics_cap"], temperature=1.0, top_p=1.0, top_k=0, seed=1234,
                            eos_token_ids=tuple(spec["stop_ids"]), pad_token_id=0)
    c = trainer.c
    out: dict[str, Any] = {"prompts": len(prompts), "cap": spec["numerics_cap"]}
    def hf_generate():
        # eager, as TRL runs it: the training layers' compiled forms are not traced through generate
        stance = getattr(torch.compiler, "set_stance", None)
        with stance("force_eager") if stance is not None else contextlib.nullcontext():
            return HFGenerateBackend(c.policy).generate(prompts, params)

    runs = {"rlcore_rollout": lambda: c.generation.generate(prompts, params), "hf_generate": hf_generate}
    for name, generate in runs.items():
        _sync()
        start = time.perf_counter()
        batch = generate()
        _sync()
        seconds = time.perf_counter() - start
        ids, mask = (t.to(c.train_device) for t in batch.sequences())
        c.policy.eval()
        with torch.no_grad():
            trained = batched_logprobs(c.actor.model, ids, mask, batch.response_ids.shape[1], 1.0, setting["micro"],
                                       batch.response_mask.to(c.train_device))
        out[name] = {**mismatch(batch.logprobs.cpu(), trained.cpu(), batch.response_mask.cpu()),
                     "seconds": seconds, "mean_len": float(batch.response_mask.sum(-1).float().mean())}
        del batch, ids, mask, trained
    out["rlcore_backend"] = _backend_name(trainer)
    return out


# ------------------------------------------------------------------------------------------------ TRL

def trl_generation_batch(spec: dict[str, Any], info: dict[str, Any]) -> int:
    """TRL's first generation batch: the most samples (a divisor of the step's, a multiple of n) whose
    HF-generate KV cache fits next to the training state (8 bytes a parameter: bf16 weights,
    gradients and two AdamW moments) and a 20 GB reserve for activations and logits."""
    import torch

    total = spec["prompts"] * spec["n"]
    if not torch.cuda.is_available() or spec["device"] != "cuda":
        return total
    free = torch.cuda.get_device_properties(0).total_memory - 8 * info["params"] - 20 * 2**30
    per_sample = (spec["prompt_max"] + spec["cap"]) * info["kv_bytes_per_token"]
    size = total
    while size > spec["n"] and (size * per_sample > free or total % size):
        size //= 2
    return max(spec["n"], size - size % spec["n"])


def run_trl(spec: dict[str, Any], setting: dict[str, Any], progress: dict[str, Any]) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from _common import import_rlcore

    import_rlcore()
    from rlcore.observe.flops import peak_flops
    from rlcore.observe.gpu import GPUMonitor

    cuda = torch.cuda.is_available() and spec["device"] == "cuda"
    rollout = spec["prompts"] * spec["n"]
    total = spec["trl_warmup"] + spec["trl_steps"]
    with open(spec["prompts_file"]) as f:
        texts = [" ".join(f"t{t}" for t in ids) for ids in json.load(f)]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"], padding_side="left")
    score = _reward_fn(spec["reward_file"])
    clock: dict[str, list[float]] = {"reward": [], "generate": [], "logprobs": [], "gen_score": []}
    lengths: list[tuple[list[int], list[int]]] = []

    def hashed_reward(completions, **kwargs):
        start = time.perf_counter()
        out = score(completions)
        clock["reward"].append(time.perf_counter() - start)
        return out

    micro, gen_batch = setting["micro"], setting["gen_batch"]
    kwargs = dict(
        output_dir=spec["run_dir"], per_device_train_batch_size=micro, gradient_accumulation_steps=rollout // micro,
        steps_per_generation=gen_batch // micro, num_generations=spec["n"], max_completion_length=spec["cap"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, learning_rate=1e-6, max_grad_norm=1.0,
        gradient_checkpointing=setting["gc"], bf16=cuda and spec["dtype"] == "bf16",
        model_init_kwargs={"dtype": "bfloat16" if spec["dtype"] == "bf16" else "float32"}, max_steps=total,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=not cuda,
        dataloader_num_workers=0)
    if setting.get("continuous_batching"):
        kwargs["use_transformers_continuous_batching"] = True
    args = GRPOConfig(**kwargs)
    stops = torch.tensor(spec["stop_ids"])

    class Probe(StoppingCriteria):
        """Never stops anything: records how far ``generate`` has got (decode steps, rows still live)."""

        def __init__(self, width: int):
            self.width, self.steps, self.start = width, 0, time.perf_counter()

        def __call__(self, input_ids, scores, **kw):
            self.steps += 1
            if self.steps % 64 == 0:
                ended = torch.isin(input_ids[:, self.width:], stops.to(input_ids.device)).any(-1)
                progress["generate"] = {"call": len(clock["generate"]) + 1, "decode_steps": self.steps,
                                        "seconds": time.perf_counter() - self.start, "rows": int(input_ids.shape[0]),
                                        "rows_live": int((~ended).sum())}
                spec["_save_progress"]()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    monitor = GPUMonitor(0.5 if cuda else 0.0)
    step_rows: list[dict[str, float]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            index = len(step_rows) + 1
            if index == spec["trl_warmup"] + 1:
                monitor.start()
                monitor.interval_summary()
            progress.update(phase="warmup" if index <= spec["trl_warmup"] else "measured", step=index,
                            step_started_at=time.time())
            spec["_save_progress"]()
            self.marks = {key: len(v) for key, v in clock.items()}
            _sync()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            _sync()
            row = {"step_s": time.perf_counter() - self.start}
            row.update({key: sum(v[self.marks[key]:]) for key, v in clock.items()})
            row.update(monitor.interval_summary())
            step_rows.append(row)
            progress.setdefault("step_times", []).append(row["step_s"])
            print(f"  {spec['system']} step {len(step_rows)}: {row['step_s']:.2f} s  generate {row['generate']:.2f} s",
                  flush=True)

    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=hashed_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": texts}),
                          processing_class=tokenizer)
    setup_s = time.perf_counter() - t0
    trainer.add_callback(StepClock())
    model = trainer.accelerator.unwrap_model(trainer.model)

    def timed(name: str, fn, probe: bool = False):
        def wrapper(*a, **k):
            if probe and "input_ids" in k:
                k["stopping_criteria"] = StoppingCriteriaList([*(k.get("stopping_criteria") or []),
                                                               Probe(k["input_ids"].shape[1])])
            _sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            _sync()
            clock[name].append(time.perf_counter() - start)
            return out
        return wrapper

    model.generate = timed("generate", model.generate, probe=True)
    if hasattr(model, "generate_batch"):
        model.generate_batch = timed("generate", model.generate_batch)
    plain_logps = trainer._get_per_token_logps_and_entropies

    def logps(*a, **k):
        if torch.is_grad_enabled():
            return plain_logps(*a, **k)
        return timed("logprobs", plain_logps)(*a, **k)

    trainer._get_per_token_logps_and_entropies = logps
    plain_gen_score = trainer._generate_and_score_completions

    def gen_score(*a, **k):
        out = timed("gen_score", plain_gen_score)(*a, **k)
        lengths.append((out["prompt_mask"].sum(1).tolist(), out["completion_mask"].sum(1).tolist()))
        return out

    trainer._generate_and_score_completions = gen_score
    try:
        trainer.train()
    finally:
        monitor.stop()
    first = spec["trl_warmup"]
    measured = step_rows[first:] or step_rows[-1:]
    mean = _parts(measured)
    calls_per_step = len(lengths) // max(1, len(step_rows))
    kept = lengths[first * calls_per_step:] or lengths[-1:]
    sequences = [p + r for prompt, resp in kept for p, r in zip(prompt, resp)]
    parts = {"rollout": mean.get("generate", 0.0), "scoring": mean.get("reward", 0.0),
             "logprobs": mean.get("logprobs", 0.0), "update": mean["step_s"] - mean.get("gen_score", 0.0)}
    parts["other"] = mean["step_s"] - sum(parts.values())
    peak = peak_flops(trainer.accelerator.device)
    flops = update_flops(model.config, sequences) / len(measured)
    result = {"step_s": mean["step_s"], "step_times": [r["step_s"] for r in step_rows], "setup_s": setup_s,
              "parts": parts, "tokens_per_step": sum(sequences) / len(measured),
              "lengths": length_stats([x for _, resp in kept for x in resp], spec["cap"]),
              "update_mfu": flops / parts["update"] / peak if peak and parts["update"] > 0 else None,
              "gpu": {k: v for k, v in mean.items() if k.startswith("gpu/")},
              "generate_calls_per_step": len(clock["generate"]) / max(1, len(step_rows)), "trl_version": trl.__version__}
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s"]
    return result


# ------------------------------------------------------------------------------------------------ workers

def worker(kind: str, spec_path: str, out_path: str) -> int:
    """One subprocess: ``build`` (the shape's files), ``rlcore`` or ``trl`` (a run at the spec's setting)."""
    sys.path.insert(0, HERE)
    from _common import import_rlcore

    import_rlcore()
    with open(spec_path) as f:
        spec = json.load(f)
    progress: dict[str, Any] = {"phase": "setup", "started_at": time.time()}
    spec["_save_progress"] = lambda: _write(spec["progress_file"], progress)
    spec["_save_progress"]()
    try:
        if kind == "build":
            result = build_shape(spec)
        elif kind == "rlcore":
            result = run_rlcore(spec, spec["setting"], progress)
        else:
            result = run_trl(spec, spec["setting"], progress)
    except BaseException as error:  # noqa: BLE001 - reported to the driver
        traceback.print_exc()
        oom = _is_oom(error)
        _write(out_path, {"error": "out of memory" if oom else f"{type(error).__name__}: {str(error)[:500]}",
                          "oom": oom})
        return OOM_EXIT if oom else 1
    _write(out_path, result)
    return 0


class Terminated(Exception):
    """The driver was sent SIGTERM (e.g. by an outer ``timeout``): the running worker is stopped and
    what it had done recorded, as for a timeout, and no further run starts."""


def _on_sigterm(signum, frame):
    raise Terminated()


def launch(kind: str, spec: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], Any]:
    """Run a worker; ``(result, exit code, "timeout" or "terminated")``. A worker stopped by its timeout or
    by the driver's SIGTERM is returned with its progress file as ``{"progress": ...}`` (and the step's
    result where it had finished it)."""
    tag = f"{kind}-{spec.get('system', '')}-{time.strftime('%H%M%S')}-{os.getpid()}-{time.perf_counter_ns() % 10**6}"
    spec = dict(spec, progress_file=os.path.join(spec["workdir"], f"progress-{tag}.json"))
    spec_path = os.path.join(spec["workdir"], f"spec-{tag}.json")
    out_path = os.path.join(spec["workdir"], f"result-{tag}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, spec_path, out_path]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code: Any = proc.wait(timeout=max(1.0, timeout_s))
    except (subprocess.TimeoutExpired, Terminated) as stop:
        os.killpg(proc.pid, 9)
        proc.wait()
        code = "terminated" if isinstance(stop, Terminated) else "timeout"
    wall = time.perf_counter() - start
    result: dict[str, Any] = {}
    stopped = code in ("timeout", "terminated")
    if not stopped and os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
    elif not stopped:
        result = {"error": f"worker exit {code}"}
    if stopped:
        result = {"error": f"timed out after {wall:.0f} s" if code == "timeout" else
                  f"stopped by SIGTERM after {wall:.0f} s"}
        if os.path.exists(spec["progress_file"]):
            with open(spec["progress_file"]) as f:
                result["progress"] = json.load(f)
            if "result" in result["progress"]:  # the step finished; what timed out came after it
                result = {**result["progress"].pop("result"), "numerics": {"error": result["error"]},
                          "progress": result["progress"]}
            result["progress"]["elapsed_in_step_s"] = (time.time() - result["progress"]["step_started_at"]
                                                       if "step_started_at" in result["progress"] else None)
    result["wall_s"] = wall
    return result, code


def ladder(system: str, spec: dict[str, Any], info: dict[str, Any], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings a system tries, in order, moving on after an out-of-memory failure."""
    n = spec["n"]
    if system == "rlcore":
        features = spec["features"]
        explicit = (spec.get("settings_override") or {}).get("slots")  # --slots wins over the paged cache's rule
        slots = explicit or (spec["prompts"] * n if features["paged_kv"] else settings["slots"])
        micro = settings["micro"]
        if features["token_budget"]:  # checkpointing decided per micro-batch by memory
            tokens = settings["tokens"]
            return [dict(slots=slots, micro=micro, tokens=tokens, gc="auto"),
                    dict(slots=slots, micro=micro, tokens=tokens, gc=True),
                    dict(slots=max(n, slots // 2), micro=max(1, micro // 2), tokens=max(1024, tokens // 2), gc=True)]
        return [dict(slots=slots, micro=micro, gc=False), dict(slots=slots, micro=micro, gc=True),
                dict(slots=max(n, slots // 2), micro=max(1, micro // 2), gc=True)]
    gen = trl_generation_batch(spec, info)
    micro = min(settings["trl_micro"], gen)
    cb = system == "trl-cb"
    steps = [dict(gen_batch=gen, micro=micro, gc=True), dict(gen_batch=gen, micro=max(1, micro // 2), gc=True),
             dict(gen_batch=max(n, gen // 2), micro=max(1, micro // 2), gc=True)]
    for step in steps:
        step["continuous_batching"] = cb
        while step["gen_batch"] % step["micro"]:
            step["micro"] //= 2
    return steps


def trl_extrapolation(row: dict[str, Any], spec: dict[str, Any], rlcore_row: dict[str, Any] | None) -> None:
    """For a TRL run cut off inside ``generate``: a lower bound of its step (the time it had spent in
    it) and an extrapolated rollout time (decode steps still needed x the mean time of a decode step
    so far, which grows with the context: an underestimate). Lengths needed per ``generate`` call:
    the longest response rlcore drew for this shape if known, else the cap."""
    progress = row.get("progress") or {}
    gen = progress.get("generate")
    if progress.get("phase") != "measured":
        return
    row["step_s_lower_bound"] = progress.get("elapsed_in_step_s")
    if not gen or not gen.get("decode_steps"):
        return
    longest = (rlcore_row or {}).get("lengths", {}).get("max") or spec["cap"]
    calls = spec["prompts"] * spec["n"] // row["setting"]["gen_batch"]
    per_step = gen["seconds"] / gen["decode_steps"]
    row["rollout_s_extrapolated"] = calls * longest * per_step
    row["extrapolation_basis"] = {"calls": calls, "decode_steps_per_call": longest, "s_per_decode_step": per_step}


# ------------------------------------------------------------------------------------------------ driver

def run_shape(shape: str, spec: dict[str, Any], systems: list[str], payload: dict[str, Any], out: str,
              deadline: float) -> None:
    """Build the shape's files and run each system within ``deadline`` (``time.perf_counter()``)."""
    spec = dict(spec, shape=shape, workdir=os.path.join(spec["root"], shape))
    os.makedirs(spec["workdir"], exist_ok=True)
    spec.update(model_dir=os.path.join(spec["workdir"], "model"), prompts_file=os.path.join(spec["workdir"], "prompts.json"),
                reward_file=os.path.join(spec["workdir"], "reward.py"))
    info_path = os.path.join(spec["workdir"], "info.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
    else:
        print(f"== {shape}: building the model", flush=True)
        info, code = launch("build", spec, max(60.0, deadline - time.perf_counter()))
        if code != 0:
            payload["results"].append({"shape": shape, "system": "build", **info})
            _write(out, payload)
            if code == "terminated":
                raise Terminated()
            return
        _write(info_path, info)
    payload.setdefault("workloads", {})[shape] = {k: v for k, v in info.items() if k != "stop_ids"} | {
        "stop_ids_head": info["stop_ids"][:8]}
    spec.update(stop_ids=info["stop_ids"])
    settings = SHAPE_SETTINGS.get(shape, TINY_SETTINGS)
    settings = {**settings, **{k: v for k, v in spec["settings_override"].items() if v}}
    for system in systems:
        if any(r.get("shape") == shape and r.get("system") == system and "step_s" in r for r in payload["results"]):
            print(f"== {shape} {system}: kept from the earlier results", flush=True)
            continue
        attempts = []
        row: dict[str, Any] = {}
        for setting in ladder(system, spec, info, settings):
            left = deadline - time.perf_counter()
            if left < 30:
                attempts.append({"setting": setting, "error": "shape budget spent"})
                break
            timeout = min(left, spec["timeout_rlcore"] if system == "rlcore" else spec["timeout_trl"])
            print(f"== {shape} {system} {setting} (timeout {timeout:.0f} s)", flush=True)
            run_spec = dict(spec, system=system, setting=setting, run_dir=os.path.join(spec["workdir"], f"run-{system}"))
            result, code = launch("rlcore" if system == "rlcore" else "trl", run_spec, timeout)
            row = {"shape": shape, "system": system, "setting": setting, **result}
            attempts.append({"setting": setting, "error": result.get("error"), "wall_s": result["wall_s"]})
            if code == "terminated":  # record what the run did, then stop
                row["attempts"] = attempts
                payload["results"].append(row)
                _write(out, payload)
                raise Terminated()
            if code != OOM_EXIT:
                break
        row["attempts"] = attempts
        if system != "rlcore" and "step_s" not in row:
            rlcore_row = next((r for r in payload["results"] if r.get("shape") == shape and r.get("system") == "rlcore"
                               and "step_s" in r), None)
            trl_extrapolation(row, spec, rlcore_row)
        payload["results"] = [r for r in payload["results"] if (r.get("shape"), r.get("system")) != (shape, system)]
        payload["results"].append(row)
        _write(out, payload)
    if not spec["keep_models"]:
        shutil.rmtree(spec["model_dir"], ignore_errors=True)
        os.remove(info_path) if os.path.exists(info_path) else None


def _f(value, fmt: str = ".2f", empty: str = "-") -> str:
    return empty if value is None else format(value, fmt)


def print_table(payload: dict[str, Any]) -> None:
    rows = payload["results"]
    print(f"\n{'shape':<13} {'system':<7} {'s/step':>8} {'vs':>6} {'rollout':>8} {'score':>6} {'logp':>6} "
          f"{'update':>7} {'tok/s':>8} {'smp/s':>6} {'len mean':>8} {'p90':>6} {'max':>6} {'mfu':>5} {'gpu':>4} "
          f"{'p10':>4}  setting")
    for r in rows:
        if "step_s" not in r:
            extra = ""
            if r.get("step_s_lower_bound"):
                extra = f" (step > {r['step_s_lower_bound']:.0f} s"
                if r.get("rollout_s_extrapolated"):
                    extra += f"; rollout extrapolated {r['rollout_s_extrapolated']:.0f} s"
                extra += ")"
            print(f"{r.get('shape', ''):<13} {r.get('system', ''):<7} failed: {r.get('error')}{extra}")
            continue
        rl = next((x for x in rows if x.get("shape") == r["shape"] and x.get("system") == "rlcore" and "step_s" in x),
                  None)
        ratio = f"{r['step_s'] / rl['step_s']:.1f}x" if rl and r is not rl else ""
        p, ln, g = r["parts"], r["lengths"], r.get("gpu", {})
        mfu = r.get("update_mfu")
        print(f"{r['shape']:<13} {r['system']:<7} {r['step_s']:8.2f} {ratio:>6} {p['rollout']:8.2f} {p['scoring']:6.2f} "
              f"{p['logprobs']:6.2f} {p['update']:7.2f} {r['tokens_per_s']:8.0f} {_f(r.get('samples_per_s'), '.1f'):>6} "
              f"{ln.get('mean', 0):8.0f} "
              f"{ln.get('p90', 0):6.0f} {ln.get('max', 0):6.0f} {_f(mfu * 100 if mfu else None, '.0f'):>5} "
              f"{_f(g.get('gpu/util_mean'), '.0f'):>4} {_f(g.get('gpu/util_p10'), '.0f'):>4}  {r['setting']}")
    print("\n(vs: the system's step time over rlcore's; smp/s: samples trained a second; mfu: the update's, %; "
          "gpu: monitor mean / p10 utilisation, %)")
    for r in rows:  # a step's seconds outside its timed parts: a part that stops its clock too early shows here
        other = (r.get("parts") or {}).get("other")
        if other is not None and "step_s" in r and other > UNTIMED_WARN * r["step_s"]:
            print(f"{r['shape']:<13} {r['system']:<7} note: {other:.2f} s of the {r['step_s']:.2f} s step are in no "
                  f"timed part (parts.other): the parts' figures, MFU included, may leave out work")
    from rlcore.rollout.engine.scheduler import TAIL_ROWS

    for r in rows:  # rlcore's rollout: where its time went (the decode steps of at most TAIL_ROWS rows: the tail)
        m = r.get("metrics", {})
        if m.get("rollout/decode_steps"):
            tail_s, tail = m.get("rollout/tail_s", 0.0), m.get("rollout/tail_steps", 0.0)
            print(f"{r['shape']:<13} {r['system']:<7} rollout {r['parts']['rollout']:.2f} s: "
                  f"{m['rollout/decode_steps']:.0f} decode steps, of them {tail:.0f} with at most {TAIL_ROWS} rows in "
                  f"{tail_s:.2f} s ({1e3 * tail_s / max(tail - 1, 1):.2f} ms a step); "
                  f"activations {_f(m.get('actor/activation_mb_per_token'), '.2f')} MB a token")
    print(f"{'shape':<13} {'rollout':<15} {'mean|d|':>9} {'max|d|':>9} {'KL k3':>9} {'mean len':>8}   numerics vs trainer")
    for r in rows:
        numerics = r.get("numerics") or {}
        for name in ("rlcore_rollout", "hf_generate"):
            if name in numerics and "abs_diff_mean" in numerics[name]:
                m = numerics[name]
                print(f"{r['shape']:<13} {name:<15} {m['abs_diff_mean']:9.2e} {m['abs_diff_max']:9.2e} "
                      f"{m['kl_k3']:9.2e} {m['mean_len']:8.0f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(*argv[1:4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                                                      "bench_reasoning.json"))
    parser.add_argument("--shapes", default=None, help=f"comma list (default {','.join(DEFAULT_SHAPES)}; "
                                                       f"--smoke: {','.join(SMOKE_SHAPES)})")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {SYSTEMS}")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, seconds (TRL only if installed)")
    for key, kind in (("prompts", int), ("n", int), ("prompt_min", int), ("prompt_max", int), ("mean_len", float),
                      ("cap", int), ("warmup", int), ("steps", int), ("trl_warmup", int), ("trl_steps", int),
                      ("numerics_prompts", int), ("numerics_cap", int), ("total_budget_s", float),
                      ("warmup_cap", int),
                      ("timeout_rlcore", float), ("timeout_trl", float)):
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="time budget of one shape (default: an equal share of --total-budget-s)")
    parser.add_argument("--slots", type=int, default=None, help="rlcore's engine slots (ppo.generation.batch_size)")
    parser.add_argument("--micro", type=int, default=None, help="rlcore's micro-batch (ppo.micro_batch_size)")
    parser.add_argument("--trl-micro", type=int, default=None, help="TRL's per_device_train_batch_size")
    parser.add_argument("--rlcore-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for rlcore (repeatable)")
    parser.add_argument("--attention-max-chunk", type=int, default=None,
                        help="rlcore: the most cache columns one program of the decode attention kernel attends "
                             "(actor.rollout_engine.attention_tuning.max_chunk; default: the kernel's, 1024; 0: no cap)")
    parser.add_argument("--workdir", default=None, help="models, runs and progress files (default: a temp dir)")
    parser.add_argument("--keep-models", action="store_true", help="keep each shape's saved model")
    parser.add_argument("--resume", action="store_true", help="keep the finished runs already in --out")
    parser.add_argument("--profile-update", action="store_true",
                        help="rlcore: one more step after the measured ones, its update under the profiler: the "
                             "device's idle gaps and the host ops they fall in (update_idle), the largest kernels")
    parser.add_argument("--fixed-lengths", action="store_true",
                        help="rlcore: response lengths drawn up front from the stop rule's distribution, the same "
                             "in every run, instead of sampled stop tokens (compares settings' step times)")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    import torch

    from _common import environment
    from _models import SHAPES

    spec: dict[str, Any] = dict(PRESETS["smoke" if args.smoke else "full"])
    for key in list(spec):
        if getattr(args, key, None) is not None:
            spec[key] = getattr(args, key)
    shapes = [s for s in (args.shapes or ",".join(SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES)).split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    for system in systems:
        if system not in SYSTEMS:
            raise SystemExit(f"--systems: unknown system {system!r}; choose from {SYSTEMS}")
    if args.smoke and any(s.startswith("trl") for s in systems):
        try:
            import trl  # noqa: F401
        except ImportError:
            print("--smoke: trl is not installed, running rlcore only", flush=True)
            systems = [s for s in systems if not s.startswith("trl")]
    if spec["prompt_min"] > spec["prompt_max"]:
        raise SystemExit("--prompt-min must not exceed --prompt-max")
    spec.update(fixed_lengths=bool(args.fixed_lengths), profile_update=bool(args.profile_update),
                attention_max_chunk=args.attention_max_chunk,
                device="cuda" if torch.cuda.is_available() and not args.smoke else "cpu",
                rlcore_overrides=list(args.rlcore_override), keep_models=args.keep_models,
                settings_override={"slots": args.slots, "micro": args.micro, "trl_micro": args.trl_micro},
                features=rlcore_features() if "rlcore" in systems else {"token_budget": False, "paged_kv": False},
                root=os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="reasoning_")))
    payload: dict[str, Any] = {"results": []}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            payload = json.load(f)
        payload.setdefault("earlier_commands", []).append(payload.get("command"))
    payload.update(env=environment(), command=" ".join(["python", "bench/bench_reasoning.py", *argv]),
                   settings={k: v for k, v in spec.items() if k != "settings_override"})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(payload["env"], flush=True)
    end = time.perf_counter() + spec["total_budget_s"]
    signal.signal(signal.SIGTERM, _on_sigterm)  # an outer `timeout` still leaves a results file
    for index, shape in enumerate(shapes):
        # each shape gets an equal share of the time left, or --budget-s when that is smaller
        share = (end - time.perf_counter()) / (len(shapes) - index)
        deadline = time.perf_counter() + min(share, args.budget_s or share)
        if share < 60:
            payload["results"].append({"shape": shape, "system": "driver", "error": "total budget spent"})
            continue
        try:
            run_shape(shape, spec, systems, payload, args.out, deadline)
        except Terminated:
            print("== stopped by SIGTERM: results so far written", flush=True)
            _write(args.out, payload)
            break
        except Exception as error:  # noqa: BLE001 - the next shape still runs
            traceback.print_exc()
            payload["results"].append({"shape": shape, "system": "driver", "error": f"{type(error).__name__}: {error}"})
        _write(args.out, payload)
    print_table(payload)
    # a TRL run cut by its timeout is an expected outcome (reported with its bound); rlcore, the
    # build or the driver failing is not
    failed = [r for r in payload["results"] if "step_s" not in r and not str(r.get("system", "")).startswith("trl")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
