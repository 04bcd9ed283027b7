"""End-to-end GRPO step: TRL's ``GRPOTrainer`` against rlcore's ``Trainer``, same model, data and settings.

Setup (one GPU): a random-init Qwen2-0.5B shape (hidden 896, 24 layers, 14/2 heads, intermediate
4864, vocab 151936, tied embeddings) saved with ``save_pretrained`` together with a word-level
tokenizer whose vocabulary is ``t0 .. t151935`` (whitespace pre-tokenizer, no download). Each step:
32 prompts x 8 samples, prompts of 128 random tokens (written as text), responses of exactly 256
tokens, temperature-1 sampling, bf16 weights, AdamW (lr 1e-6, grad-norm clip 1.0), a constant reward,
no KL term (TRL 1.16 defaults to ``beta=0``; rlcore runs ``ppo.kl_coeff=0``, so neither loads a
reference model), one optimizer step per rollout, micro-batches of 32 sequences.

Fixed length: the tokenizer's EOS (and pad) token is ``t0``, id 0, which no prompt contains. TRL
suppresses it while sampling (``generation_kwargs={"suppress_tokens": [0]}``), so every completion
runs to ``max_completion_length``; rlcore's run clears the trainer's EOS list, so its engine never
stops early either (``t0`` may then be drawn as an ordinary token, with probability ~1/151936).

Each system runs in its own subprocess (no shared allocator or CUDA-graph state), one after the
other: warm-up steps, then measured steps; seconds per step is the mean wall time between
consecutive optimizer steps with the device synchronised. Tokens/s counts prompt + completion
tokens of the step (``256 x 384``). rlcore also reports its step breakdown (``time/*`` metrics of
``Trainer.train_step``); TRL its time inside ``generate``.

Systems: ``trl`` (HF generate, gradient checkpointing on: TRL's default), ``rlcore`` (the default
rollout backend, gradient checkpointing off: rlcore's default) and ``rlcore-gc`` (rlcore with
gradient checkpointing on, to match TRL).

Run (GPU):  python bench/bench_grpo_step.py --out results/grpo_step.json
            needs trl (1.16), datasets and rlcore's own dependencies; on an image without them, install
            their wheels with ``pip install --no-deps --target DIR`` and put DIR, plus a directory
            holding ``core/`` as ``rlcore`` and ``plugins/`` as ``rlcore/plugins``, on PYTHONPATH.
Smoke test: python bench/bench_grpo_step.py --tiny     (CPU, tiny shapes; the numbers mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
EOS_ID = 0  # ``t0``: the EOS and pad token; prompts never contain it
PRESETS = {
    "full": dict(shape="qwen2-0.5b", prompts=32, n=8, prompt_len=128, response_len=256, micro=32, warmup=2,
                 steps=3, dtype="bf16"),
    "tiny": dict(shape="tiny", prompts=4, n=8, prompt_len=16, response_len=16, micro=8, warmup=1, steps=2,
                 dtype="fp32"),
}
SYSTEMS = ("rlcore", "trl", "rlcore-gc")
REWARD_SOURCE = '''"""Constant reward of the GRPO step benchmark."""


def compute_score(responses, **kwargs):
    return [1.0] * len(responses)
'''


# ------------------------------------------------------------------------------------------------ data

def prompt_texts(rows: int, length: int, vocab: int, seed: int = 0) -> list[str]:
    """``rows`` prompts of ``length`` random tokens ``t1 .. t{vocab-1}`` as whitespace-separated text."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(1, vocab)}" for _ in range(length)) for _ in range(rows)]


class RandomTokenPrompts:
    """Map-style dataset for ``data.custom_cls``: rows with ``prompt`` text and its ``input_ids``."""

    def __init__(self, data_files: list, prompt_key: str = "prompt", rows: int = 256, length: int = 128,
                 vocab: int = 151936, seed: int = 0):
        self.key = prompt_key
        self.texts = prompt_texts(int(rows), int(length), int(vocab), int(seed))

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        text = self.texts[i]
        return {self.key: text, "input_ids": [int(w[1:]) for w in text.split()]}


# ------------------------------------------------------------------------------------------------ setup

def build_model_dir(path: str, shape: str, dtype: str) -> str:
    """Random-init model of ``shape`` and the ``t0 .. t{V-1}`` word-level tokenizer, saved in ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    from bench_rollout import SHAPES

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    spec = SHAPES[shape]
    vocab = {f"t{i}": i for i in range(spec["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0", unk_token="t0",
                                   padding_side="left")
    config = Qwen2Config(**spec, max_position_embeddings=4096, bos_token_id=None, eos_token_id=EOS_ID,
                         pad_token_id=EOS_ID)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    del model
    return path


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _steady(times: list[float], warmup: int) -> float:
    measured = times[warmup:] or times[-1:]
    return sum(measured) / len(measured)


# ------------------------------------------------------------------------------------------------ rlcore

def rlcore_overrides(spec: dict[str, Any], gradient_checkpointing: bool) -> list[str]:
    rollout = spec["prompts"] * spec["n"]
    kwargs = {"rows": spec["rows"], "length": spec["prompt_len"], "vocab": spec["vocab"]}
    return [f"actor.model_path={spec['model_dir']}", f"actor.dtype={spec['dtype']}", "actor.lr=1e-6",
            "actor.grad_clip=1.0", f"actor.gradient_checkpointing={str(gradient_checkpointing).lower()}",
            "algorithm.adv_estimator=grpo", f"ppo.rollout_batch_size={spec['prompts']}",
            f"ppo.generation.n={spec['n']}", f"ppo.generation.max_new_tokens={spec['response_len']}",
            f"ppo.generation.batch_size={rollout}", "ppo.generation.temperature=1.0", "ppo.generation.top_p=1.0",
            "ppo.generation.top_k=0", "ppo.kl_coeff=0", "ppo.ppo_epochs=1", "ppo.mini_batch_size=0",
            f"ppo.micro_batch_size={spec['micro']}", f"data.max_prompt_length={spec['prompt_len']}",
            f"data.custom_cls.path={os.path.abspath(__file__)}", "data.custom_cls.name=RandomTokenPrompts",
            *(f"data.custom_cls.kwargs.{k}={v}" for k, v in kwargs.items()),
            f"custom_reward_function.path={spec['reward_file']}", "custom_reward_function.name=compute_score",
            f"trainer.max_steps={spec['warmup'] + spec['steps']}", "trainer.progress=false",
            "trainer.gpu_monitor=true", f"trainer.output_dir={spec['run_dir']}", "trainer.resume=disable",
            "trainer.export_final=false", f"trainer.device={spec['device']}", *spec.get("rlcore_overrides", [])]


def run_rlcore(spec: dict[str, Any], gradient_checkpointing: bool) -> dict[str, Any]:
    from _common import import_rlcore, run_train_steps

    import_rlcore()
    from rlcore.config import load_config
    from rlcore.distributed.init import init_distributed
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.trainer.loop import Trainer

    cfg = load_config([], rlcore_overrides(spec, gradient_checkpointing))
    t0 = time.perf_counter()
    trainer = Trainer(cfg, build_plugin_manager(list(cfg.plugins)), init_distributed(cfg.trainer.device))
    trainer.c.eos_ids = []  # fixed-length responses (see the module docstring)
    setup_s = time.perf_counter() - t0
    times, steps = run_train_steps(trainer, spec["warmup"] + spec["steps"])
    measured = steps[spec["warmup"]:] or steps[-1:]
    breakdown = {k: sum(s.get(k, 0.0) for s in measured) / len(measured)
                 for k in sorted({k for s in measured for k in s if k.startswith("time/")})}
    keep = ("response/length_mean", "perf/mfu", "memory/peak_gb", "actor/grad_norm")
    extra = {k: measured[-1][k] for k in measured[-1] if k in keep or k.startswith("gpu/")}
    return {"step_s": _steady(times, spec["warmup"]), "step_times": times, "setup_s": setup_s,
            "breakdown": breakdown, "last": extra,
            "rollout_backend": ", ".join(sorted({type(b).__name__ for b in trainer.c.generation.backends.values()}))}


# ------------------------------------------------------------------------------------------------ TRL

def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available() and spec["device"] != "cpu"
    rollout = spec["prompts"] * spec["n"]
    total = spec["warmup"] + spec["steps"]
    texts = prompt_texts(spec["rows"], spec["prompt_len"], spec["vocab"])
    # Loaded as the plain fast tokenizer it is: AutoTokenizer (transformers 5) picks the model type's
    # Qwen2Tokenizer, which rebuilds a BPE model and cannot encode the word-level vocabulary.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"], padding_side="left")

    def constant_reward(completions, **kwargs):
        return [1.0] * len(completions)

    args = GRPOConfig(
        output_dir=spec["run_dir"], per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=rollout // spec["micro"], num_generations=spec["n"],
        max_completion_length=spec["response_len"], temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        learning_rate=1e-6, max_grad_norm=1.0, gradient_checkpointing=True, bf16=cuda and spec["dtype"] == "bf16",
        model_init_kwargs={"dtype": "bfloat16" if spec["dtype"] == "bf16" else "float32"},
        generation_kwargs={"suppress_tokens": [EOS_ID]}, max_steps=total, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=not cuda, dataloader_num_workers=0)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_begin(self, *a, **k):
            _sync()
            self.ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            _sync()
            self.ends.append(time.perf_counter())
            print(f"  trl step {len(self.ends) - 1}: {self.ends[-1] - self.ends[-2]:.3f} s", flush=True)

    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=constant_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tokenizer)
    setup_s = time.perf_counter() - t0
    clock = StepClock()
    trainer.add_callback(clock)
    gen_times: list[float] = []
    model = trainer.accelerator.unwrap_model(trainer.model)
    plain_generate = model.generate

    def timed_generate(*a, **k):
        _sync()
        start = time.perf_counter()
        out = plain_generate(*a, **k)
        _sync()
        gen_times.append(time.perf_counter() - start)
        return out

    model.generate = timed_generate
    trainer.train()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": _steady(times, spec["warmup"]), "step_times": times, "setup_s": setup_s,
            # generate calls per optimizer step (one: TRL generates the whole 256-sample batch at once)
            "generate_calls": len(gen_times),
            "breakdown": {"time/generate_s": _steady(gen_times, spec["warmup"]) * len(gen_times) / len(times)}
            if gen_times else {},
            "last": {"completions/mean_length": logs[-1]["completions/mean_length"]} if logs else {},
            "trl_version": trl.__version__}


# ------------------------------------------------------------------------------------------------ driver

def worker(system: str, spec_path: str, out_path: str) -> int:
    sys.path.insert(0, HERE)
    with open(spec_path) as f:
        spec = json.load(f)
    spec["run_dir"] = os.path.join(spec["workdir"], f"run-{system}")
    result = run_trl(spec) if system == "trl" else run_rlcore(spec, gradient_checkpointing=system == "rlcore-gc")
    result["system"] = system
    result["tokens_per_step"] = spec["prompts"] * spec["n"] * (spec["prompt_len"] + spec["response_len"])
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s"]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def launch(system: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    spec_path = os.path.join(spec["workdir"], "spec.json")
    out_path = os.path.join(spec["workdir"], f"result-{system}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    print(f"== {system}", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, spec_path, out_path]
    start = time.perf_counter()
    try:
        code = subprocess.run(cmd, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    if code != 0 or not os.path.exists(out_path):
        return {"system": system, "error": f"worker exit {code}", "wall_s": time.perf_counter() - start}
    with open(out_path) as f:
        result = json.load(f)
    result["wall_s"] = time.perf_counter() - start
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    trl_row = next((r for r in rows if r["system"] == "trl" and "step_s" in r), None)
    print(f"\n{'system':<10} {'s/step':>8} {'tokens/s':>10} {'vs TRL':>7}  breakdown (s)")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<10} failed: {r.get('error')}")
            continue
        ratio = f"{trl_row['step_s'] / r['step_s']:.2f}x" if trl_row else "-"
        parts = "  ".join(f"{k[5:-2]} {v:.3f}" for k, v in r["breakdown"].items() if k != "time/step_s")
        print(f"{r['system']:<10} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {ratio:>7}  {parts}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(*argv[1:4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "bench_grpo_step.json"))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    parser.add_argument("--rlcore-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for the rlcore systems (repeatable), e.g. "
                             "trainer.enable_profiling=true to write a trace of the measured steps")
    parser.add_argument("--shape", default=None, help="model shape of bench_rollout.SHAPES (default qwen2-0.5b)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--micro", type=int, default=None, help="sequences per forward/backward micro-batch")
    parser.add_argument("--workdir", default=None, help="model, runs and results (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="per system")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    import torch
    from _common import environment, write_json

    from bench_rollout import SHAPES

    spec = dict(PRESETS["tiny" if args.tiny else "full"])
    for key in ("shape", "warmup", "steps", "micro"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    spec["device"] = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    spec["rlcore_overrides"] = list(args.rlcore_override)
    spec["vocab"] = SHAPES[spec["shape"]]["vocab_size"]
    spec["rows"] = spec["prompts"] * (spec["warmup"] + spec["steps"] + 1)
    spec["workdir"] = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="grpo_step_"))
    os.makedirs(spec["workdir"], exist_ok=True)
    spec["reward_file"] = os.path.join(spec["workdir"], "constant_reward.py")
    with open(spec["reward_file"], "w") as f:
        f.write(REWARD_SOURCE)
    payload: dict[str, Any] = {"env": environment(), "command": " ".join(["python", "bench/bench_grpo_step.py",
                                                                            *argv]), "settings": spec, "results": []}
    print(payload["env"], flush=True)
    t0 = time.perf_counter()
    spec["model_dir"] = build_model_dir(os.path.join(spec["workdir"], "model"), spec["shape"], spec["dtype"])
    payload["build_model_s"] = time.perf_counter() - t0
    for system in [s for s in args.systems.split(",") if s]:
        if system not in SYSTEMS:
            raise SystemExit(f"--systems: unknown system {system!r}; choose from {SYSTEMS}")
        payload["results"].append(launch(system, spec, args.timeout_s))
        write_json(args.out, payload)
    print_table(payload["results"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
