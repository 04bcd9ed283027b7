"""Test kit for plugin authors, loaded by pytest through the ``pytest11`` entry point.

Fixtures:

* ``rlcore_pm`` — a fresh plugin manager with the built-in defaults registered.
* ``rlcore_register`` — ``rlcore_register(plugin, name=None)`` registers a plugin for one test only.
* ``tiny_model_dir`` — a tiny causal LM and its tokenizer, built on the spot (no download), saved as a
  Hugging Face directory; shared by the whole test session.
* ``tiny_tokenizer`` — the tokenizer of ``tiny_model_dir`` loaded through ``from_pretrained``.

Helpers usable outside pytest: :func:`make_tiny_model_dir`, :func:`run_cli`, :func:`teacher_forced_logprobs`.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Callable, Iterator, Sequence

import pytest


def make_tiny_model_dir(path: str, *, arch: str = "qwen2", hidden_size: int = 64, layers: int = 2,
                        seed: int = 0) -> str:
    """Build a tiny ``arch`` (qwen2 | llama | mistral) model plus tokenizer in ``path``; return ``path``."""
    from rlcore.demo import build_model_dir

    return build_model_dir(path, hidden_size=hidden_size, layers=layers, seed=seed, arch=arch)


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """Run ``rlcore`` in this process; return ``(exit_code, stdout, stderr)``."""
    from rlcore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse exits
            code = e.code if isinstance(e.code, int) else 1
    return int(code or 0), out.getvalue(), err.getvalue()


@pytest.fixture
def rlcore_pm():
    from rlcore.plugin_manager import build_plugin_manager

    return build_plugin_manager([])


@pytest.fixture
def rlcore_register(rlcore_pm) -> Iterator[Callable[..., Any]]:
    registered: list[str] = []

    def register(plugin: Any, name: str | None = None) -> Any:
        name = name or getattr(plugin, "__name__", None) or f"test-plugin-{len(registered)}"
        rlcore_pm.register_plugin(plugin, name)
        registered.append(name)
        return plugin

    yield register
    for name in registered:
        rlcore_pm.unregister_plugin(name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("rlcore-tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def teacher_forced_logprobs(model, batch, temperature: float):
    """``[B, R]`` log-probabilities of a :class:`~rlcore.rollout.base.RolloutBatch`'s response tokens
    under ``model`` run once over prompt + response (teacher forcing), at ``temperature`` (``<= 0``: 1);
    what a backend's ``logprobs`` must equal on the response mask."""
    import torch

    ids, mask = batch.sequences()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = batch.prompt_ids.shape[1]
    scaled = logits[:, width - 1:-1] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
