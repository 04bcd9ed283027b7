"""The sizes of a decoder-only model, read from its Hugging Face config under the names the common
families use (``hidden_size`` / ``n_embd`` / ``d_model``, ``num_hidden_layers`` / ``n_layer`` /
``num_layers``, ...). One reader for the estimates that need them: the update's activation memory
(:mod:`rlcore.trainer.recompute`), the rollout's memory per sample (:mod:`rlcore.rollout.autosize`)
and the FLOPs behind MFU (:mod:`rlcore.observe.flops`)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

#: config names of each size, in the order they are looked up
NAMES = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "inter": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab": ("vocab_size",),
}


class DecoderShape(NamedTuple):
    """A decoder's sizes; 0 where the config does not say (``heads``: 0 too, so callers can tell)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int  # the attention heads where the config names no key/value heads
    head_dim: int  # hidden // heads where the config names none
    inter: int  # 4 * hidden where the config names none
    vocab: int

    @property
    def kv(self) -> int:
        """Key/value width of a token in one layer (key/value heads x head dim)."""
        return self.kv_heads * self.head_dim

    def missing(self) -> list[str]:
        """The config names of the sizes no estimate can do without (hidden, layers, heads) that are absent."""
        return [NAMES[name][0] for name in ("hidden", "layers", "heads") if not getattr(self, name)]


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``config`` (an object or a mapping) sets to something other than None."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def decoder_shape(config: Any) -> DecoderShape:
    """The sizes of the decoder ``config`` describes (a Hugging Face config object or a mapping)."""
    def size(key: str) -> int:
        return int(config_value(config, *NAMES[key], default=0) or 0)

    hidden, heads = size("hidden"), size("heads")
    return DecoderShape(hidden=hidden, layers=size("layers"), heads=heads,
                        kv_heads=size("kv_heads") or heads,
                        head_dim=size("head_dim") or (hidden // heads if heads else 0),
                        inter=size("inter") or 4 * hidden, vocab=size("vocab"))
