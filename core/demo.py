"""The built-in demo: a tiny model, a tokenizer trained on the spot, and a task a policy can learn from scratch.

Task ("alphabet"): a prompt is a few random letters, e.g. ``"c k a f"``; the response should continue
the (cyclic) alphabet from the prompt's last letter: ``"g h i j"``. The rule reward is the share of the
first :data:`ANSWER_LEN` response letters that are right. A freshly initialised model scores near 0
(with tied embeddings it tends to repeat its input instead); a trained one approaches 1. Nothing is downloaded: the tokenizer is
trained with ``tokenizers`` and the model built from a ``transformers`` config, both saved as a
normal Hugging Face directory and loaded back through ``from_pretrained``.
"""

from __future__ import annotations

import os
import random
from typing import Any, Sequence

LETTERS = tuple("abcdefghijkl")
ANSWER_LEN = 4
SPECIALS = ("<pad>", "<eos>", "<unk>")
TRAIN_PROMPTS = 4096
VAL_PROMPTS = 256

#: Settings of ``rlcore train`` with no arguments (user overrides still apply on top).
DEMO_OVERRIDES = (
    "ppo.rollout_batch_size=16",
    "ppo.generation.n=4",
    "ppo.generation.max_new_tokens=6",
    "ppo.generation.temperature=1.0",
    "ppo.mini_batch_size=32",
    "ppo.ppo_epochs=2",
    "ppo.kl_coeff=0.01",
    "ppo.entropy_coeff=0.0",
    "actor.lr=2e-3",
    "actor.warmup_steps=5",
    "critic.lr=2e-3",
    "trainer.max_steps=80",
    "trainer.log_steps=10",
    "trainer.eval_samples=128",
    "trainer.output_dir=runs/demo",
    "plugins=[sparse-logging]",
    "trainer.resume=disable",
    "data.max_prompt_length=16",
)

#: Keys whose presence means the user gave data or a model (no demo then).
_SOURCE_KEYS = ("data.train_files", "actor.model_path", "data.custom_cls.path")


def is_demo(config_files: Sequence[str], overrides: Sequence[str], plugins: Sequence[str] = (),
            source_keys: Sequence[str] = _SOURCE_KEYS) -> bool:
    """No config file, no data, no model (none of ``source_keys`` given) and no plugin that provides
    data: ``rlcore train`` runs the built-in demo. A selected plugin implementing
    ``rlcore_dataset_provider`` is a data source even when it reads no files."""
    keys = {o.split("=", 1)[0] for o in overrides}
    if config_files or set(source_keys) & keys:
        return False
    if plugins:
        from rlcore.plugin_manager import build_plugin_manager, provides_data

        return not provides_data(build_plugin_manager(plugins))
    return True


def with_demo_preset(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with :data:`DEMO_OVERRIDES` in front (the user's win), for a command that runs the demo."""
    return list(DEMO_OVERRIDES) + list(overrides)


def demo_preset_keys(overrides: Sequence[str]) -> set[str]:
    """The keys the demo preset sets that the user's ``overrides`` do not."""
    return {o.split("=", 1)[0] for o in DEMO_OVERRIDES} - {o.split("=", 1)[0] for o in overrides}


def announce(cfg: Any, demo: bool, provides_data: bool = False) -> None:
    """Say at start that the run is the demo, or trains on the demo's task or model for want of the
    user's (``provides_data``: a selected plugin is the data source)."""
    import logging

    log = logging.getLogger("rlcore")
    if demo:
        log.warning("no data or model given: running the built-in demo (tiny model, alphabet task)")
    elif not cfg.data.train_files and not cfg.data.custom_cls.path and not provides_data:
        log.warning("data.train_files is not set: the run trains on the built-in demo task (the alphabet "
                    "prompts)%s", "" if cfg.actor.model_path else " with the demo's tiny model")


#: Words of the demo's tool task (:class:`LookupEnv`): a call of the ``lookup`` tool written as one
#: word, so a tiny model can learn to emit it; the stop string ``</tool_call>`` ends its turn.
TOOL_CALL = '<tool_call>{"name":"lookup","arguments":{}}</tool_call>'
TOOL_WORDS = (TOOL_CALL, "<tool_response>", "</tool_response>")


def build_tokenizer(save_dir: str, extra_words: Sequence[str] = ()):
    """Train a word-level tokenizer over the demo alphabet (plus ``extra_words``) and save it as a HF
    tokenizer directory whose ``tokenizer_config.json`` names the generic ``PreTrainedTokenizerFast``
    class (loaded by :func:`rlcore.trainer.models.load_tokenizer` as saved, words joined by spaces)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIALS), min_frequency=1)
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(LETTERS) for _ in range(8)) for _ in range(200)] + list(extra_words)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")
    fast.save_pretrained(save_dir)
    # The generic class by the name both transformers 4 and 5 know: the directory loads back as saved
    # (rlcore.trainer.models.load_tokenizer), not as the model type's own tokenizer class.
    config_path = os.path.join(save_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return fast


def build_model_dir(save_dir: str, *, hidden_size: int = 64, layers: int = 2, seed: int = 0,
                    arch: str = "qwen2", extra_words: Sequence[str] = ()) -> str:
    """Write a tiny randomly initialised causal LM plus its tokenizer to ``save_dir``; return the path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    os.makedirs(save_dir, exist_ok=True)
    tok = build_tokenizer(save_dir, extra_words)
    config_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}[arch]
    config = config_cls(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(save_dir)
    return save_dir


#: Files of a complete demo model directory.
DEMO_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def ensure_demo_model(root: str) -> str:
    """Build the demo model directory under ``root`` once; later calls reuse it.

    The build is atomic: it writes into a temporary directory that is renamed into place when
    complete, so a process killed mid-build leaves no directory that later runs would take for a
    model (one left by an older, non-atomic build is built again)."""
    import shutil

    path = os.path.join(root, "demo-model")
    if all(os.path.exists(os.path.join(path, name)) for name in DEMO_MODEL_FILES):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-demo-model-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_model_dir(tmp)
    if os.path.exists(path):  # an incomplete directory: moved aside, then removed
        trash = os.path.join(root, f".trash-demo-model-{os.getpid()}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, path)
    return path


def demo_model(output_dir: str, dist: Any) -> str:
    """The demo model directory of a run (``<output_dir>/_demo/demo-model``): built by the main
    rank (``dist``: a :class:`~rlcore.protocols.DistInfo`) on first use, then loaded by every rank."""
    import torch

    root = os.path.join(output_dir, "_demo")
    # Building the model draws from the global RNG: fork it so a first run (which builds) and a
    # later one (which loads) train from the same random state.
    with torch.random.fork_rng(devices=[]):
        if dist.is_main:
            ensure_demo_model(root)
    from rlcore.distributed.init import barrier

    barrier()
    return ensure_demo_model(root)


#: What the trainer says when the user gave data (files, a custom dataset or a dataset plugin) but no model.
NO_MODEL_WARNING = ("actor.model_path is not set: the policy is the demo's tiny model (%s, a word tokenizer of "
                    "the demo's 12 letters) trained on your data; set actor.model_path to a Hugging Face model "
                    "directory to train your own")


def use_demo_model(cfg: Any, dist: Any, provides_data: bool = False) -> None:
    """The demo preset's model: where ``actor.model_path`` is empty, set it to the run's demo model
    (:func:`demo_model`, built by the main rank), with a warning when the user gave data
    (``data.train_files``, ``data.custom_cls.path`` or, ``provides_data``, a dataset plugin). Called by
    ``rlcore train`` (every rank, and each worker it launches) before the trainer is built; the
    trainer itself requires ``actor.model_path``."""
    if cfg.actor.model_path:
        return
    path = demo_model(str(cfg.trainer.output_dir), dist)
    if dist.is_main and (cfg.data.train_files or cfg.data.custom_cls.path or provides_data):
        import logging

        logging.getLogger("rlcore").warning(NO_MODEL_WARNING, path)
    cfg.actor.model_path = path


def demo_tokenizer() -> Any:
    """The demo model's tokenizer, built in a temporary directory (removed again) and loaded as the
    trainer loads it: what ``rlcore validate`` hands the factory hooks when ``actor.model_path`` is
    empty (nothing is written to ``trainer.output_dir``)."""
    import tempfile

    from rlcore.trainer.models import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="rlcore-demo-tokenizer-") as tmp:
        build_tokenizer(tmp)
        return load_tokenizer(tmp)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 5)))


def demo_rows(split: str, n: int | None = None) -> list[dict[str, Any]]:
    """Rows of the alphabet task; ``train`` and ``val`` use different seeds."""
    seed, default_n = (1, TRAIN_PROMPTS) if split == "train" else (2, VAL_PROMPTS)
    rng = random.Random(seed)
    rows = []
    for _ in range(n or default_n):
        prompt = _prompt(rng)
        rows.append({"prompt": prompt, "ground_truth": " ".join(expected_answer(prompt)),
                     "data_source": "demo_alphabet"})
    return rows


class DemoDataset:
    """Map-style dataset of the alphabet task (rows carry ``input_ids``)."""

    def __init__(self, tokenizer: Any, split: str):
        self.rows = demo_rows(split)
        for row in self.rows:
            row["input_ids"] = tokenizer.convert_tokens_to_ids(row["prompt"].split())

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.rows[i])


def demo_dataset(tokenizer: Any, split: str) -> DemoDataset:
    return DemoDataset(tokenizer, split)


def expected_answer(prompt: str) -> list[str]:
    """The ``ANSWER_LEN`` letters that follow the prompt's last letter in the cyclic alphabet."""
    last = prompt.split()[-1]
    start = LETTERS.index(last)
    return [LETTERS[(start + k) % len(LETTERS)] for k in range(1, ANSWER_LEN + 1)]


def alphabet_score(prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
    """Share of the first ``ANSWER_LEN`` response letters that follow the letter before them (batched).

    The letter before the first one is the prompt's last letter, so a perfect answer to ``"c k a f"`` is
    ``"g h i j"``. Each position is judged on its own (``"g x i j"`` scores 0.5: ``x`` and ``i`` are wrong,
    ``j`` follows ``i``). Letters are single characters, so the score does not depend on how a tokenizer
    joins them when decoding (``"ckaf"`` and ``"c k a f"`` are the same prompt).
    """
    scores = []
    for prompt, response in zip(prompts, responses):
        letters = [c for c in prompt if not c.isspace()]
        if not letters or letters[-1] not in LETTERS:
            scores.append(0.0)
            continue
        prev, hits = letters[-1], 0
        for ch in [c for c in response if not c.isspace()][:ANSWER_LEN]:
            if prev in LETTERS and ch == LETTERS[(LETTERS.index(prev) + 1) % len(LETTERS)]:
                hits += 1
            prev = ch
        scores.append(hits / ANSWER_LEN)
    return scores


# ------------------------------------------------------------------------------ the tool task

SECRET_LEN = 1
#: The share of the tool task's reward given for a well-formed ``lookup`` call.
CALL_REWARD = 0.2


def lookup_rows(split: str, n: int, env: str = "demo_lookup") -> list[dict[str, Any]]:
    """Rows of the tool task: a prompt of random letters, and a secret of :data:`SECRET_LEN` letters
    that only the ``lookup`` tool returns (nothing in the prompt predicts it)."""
    rng = random.Random({"train": 11, "val": 12}.get(split, 13))
    return [{"prompt": _prompt(rng), "secret": " ".join(rng.choice(LETTERS) for _ in range(SECRET_LEN)), "env": env}
            for _ in range(n)]


def build_tool_model_dir(save_dir: str) -> str:
    """The demo model with the tool task's words in its vocabulary (a Llama-family config: its
    tokenizer directory loads back as the word-level tokenizer that was saved)."""
    return build_model_dir(save_dir, arch="llama", extra_words=TOOL_WORDS)


class LookupEnv:
    """``demo_lookup``: the answer is the row's secret, which only the ``lookup`` tool tells.

    A turn with a well-formed ``lookup`` call (``<tool_call>{"name": "lookup", ...}</tool_call>``,
    parsed by the configured tool-call parser) is answered with the secret as a plain message
    (a tiny model copies a letter it has just read more easily than one inside markup); any other
    turn is the answer and ends the episode. Reward: :data:`CALL_REWARD` for a call in the first
    turn (a hint to start from; a call in a later turn takes it back), plus ``1 - CALL_REWARD``
    times the share of the secret's letters the answer has right, position by position. Without the tool an
    answer is a guess (each letter right one time in ``len(LETTERS)``), so a fresh model scores
    about 0.1 and a trained one near 1.
    """

    observation_role = "user"

    def __init__(self, config: dict | None = None):
        from rlcore.envs.tools import parse_hermes

        if config:
            raise ValueError(f"plugin_config.demo_lookup.{sorted(config)[0]}: the 'demo_lookup' environment has "
                             "no settings")
        self.parser = parse_hermes
        self.secret: list[str] = []

    def start(self, row: dict[str, Any]):
        self.secret = str(row["secret"]).split()
        return None

    def step(self, turn):
        from rlcore.envs.base import Step
        from rlcore.envs.tools import ToolCall

        parsed = self.parser(turn.text)
        calls = [c for c in parsed.calls if isinstance(c, ToolCall) and c.name == "lookup"]
        if calls and not turn.truncated:
            return Step(observation=" ".join(self.secret),
                        reward=CALL_REWARD if turn.index == 0 else -CALL_REWARD,
                        metrics={"tool_calls": float(len(parsed.calls)),
                                 "tool_errors": float(len(parsed.calls) - len(calls))})
        if parsed.calls:
            return Step(reward=0.0, done=True, metrics={"tool_calls": float(len(parsed.calls)),
                                                         "tool_errors": float(len(parsed.calls))})
        answer = turn.text.split()
        hits = sum(a == b for a, b in zip(answer, self.secret))
        return Step(reward=(1.0 - CALL_REWARD) * hits / len(self.secret), done=True)
