"""A Llama-family decoder forward (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over weights read from a HF model.

The engine does not call the Hugging Face module: it reads its parameters (RMSNorm, RoPE
tables, GQA attention, SiLU-gated MLP, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm
applied before RoPE, tied embeddings) and runs its own
passes over a pre-allocated KV cache:

* :func:`prefill` (here) — left-padded prompts of some slots, positions taken from the attention mask;
* :func:`rlcore.rollout.engine.decode.decode` — one token for the first ``n`` slots, every slot at its
  own cache index, free of host synchronisation so that it can be captured in a CUDA graph.

The KV cache is one tensor ``[L, 2, B, KVH, S, D]`` (layers, key/value, slots, kv heads, cache
length, head dim). Key validity lives in an additive bias ``[B, S]`` (0 or ``-inf``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from rlcore.kernels.decode_attention import attend, gather_pages
from rlcore.rollout.adapters import effective_weight, unwrap

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: RoPE variants whose cos/sin depend on the position alone (a table can be precomputed).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class DecoderSpec:
    """Shapes and constants of a supported decoder."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    sliding_window: int | None
    #: per-head RMSNorm of the queries and keys (weights ``[head_dim]``) before RoPE, as Qwen3 has
    qk_norm: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if getattr(config, "model_type", "") in ("qwen2", "qwen3"):
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return int(window) if "sliding_attention" in layer_types else None
        return int(window) if getattr(config, "use_sliding_window", False) else None
    return int(window)


def decoder_spec(model) -> DecoderSpec:
    """Read the decoder's shapes, raising ``ValueError`` when the engine cannot run ``model``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"rollout engine: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"rollout engine: hidden_act {config.hidden_act!r} is not 'silu'")
    rope_type = _rope_type(config)
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rollout engine: rope_type {rope_type!r} is not one of {STATIC_ROPE_TYPES}")
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or getattr(model, "lm_head", None) is None:
        raise ValueError("rollout engine: expected model.model.layers, model.model.rotary_emb and model.lm_head")
    attn = layers[0].self_attn
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if attn.q_proj.weight.shape[0] != heads * head_dim or heads % kv_heads:
        raise ValueError("rollout engine: q_proj shape does not match heads x head_dim")
    return DecoderSpec(
        num_layers=len(layers), hidden_size=config.hidden_size, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=model.lm_head.weight.shape[0],
        rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)), sliding_window=_sliding_window(config),
        qk_norm=_qk_norm(attn, head_dim),
    )


def _qk_norm(attn, head_dim: int) -> bool:
    """Whether the attention has per-head q/k RMSNorms (Qwen3); ``ValueError`` for q/k norms of
    another form (one of the two, or over more than one head)."""
    norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    if norms == [None, None]:
        return False
    shapes = [tuple(getattr(getattr(norm, "weight", None), "shape", ())) for norm in norms]
    if shapes != [(head_dim,), (head_dim,)]:
        raise ValueError(f"rollout engine: q/k norms must both be per-head RMSNorms of weight [{head_dim}], "
                         f"got weights {shapes}")
    return True


def supports(model, max_seq_len: int | None = None) -> bool:
    """Whether the engine can run ``model`` (and, given ``max_seq_len``, its sliding window)."""
    try:
        spec = decoder_spec(unwrap(model))
    except (ValueError, AttributeError, TypeError):
        return False
    window = spec.sliding_window
    return window is None or max_seq_len is None or window >= max_seq_len


@torch.no_grad()
def rope_table(model, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float32 ``[length, D]`` for positions ``0..length-1``, from the model's own
    rotary module (so every static RoPE variant and ``rope_theta`` spelling is honoured)."""
    rotary = model.model.rotary_emb
    inv = rotary.inv_freq
    positions = torch.arange(length, device=inv.device)[None]
    probe = torch.zeros(1, dtype=torch.float32, device=inv.device)
    cos, sin = rotary(probe, positions)
    return cos[0].float().to(device), sin[0].float().to(device)


def _param(tensor: torch.Tensor | None, dtype, device, share: bool) -> torch.Tensor | None:
    if tensor is None:
        return None
    if share:
        return tensor.detach()
    return tensor.detach().to(device=device, dtype=dtype, copy=True)


def _fused(parts: list[torch.Tensor | None], dtype, device) -> torch.Tensor | None:
    if parts[0] is None:
        return None
    return torch.cat([p.detach().to(device=device, dtype=dtype) for p in parts], dim=0)


def _bias(linear) -> torch.Tensor | None:
    base = linear.get_base_layer() if hasattr(linear, "get_base_layer") else linear  # a LoRA layer's base
    return getattr(base, "bias", None)


@dataclass
class LayerWeights:
    """One decoder layer. ``qkv`` and ``gate_up`` hold one fused matrix or the separate ones."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: list[torch.Tensor]
    gate_up_bias: list[torch.Tensor | None]
    down: torch.Tensor
    down_bias: torch.Tensor | None
    #: ``(q_norm, k_norm)`` per-head RMSNorm weights ``[D]`` (Qwen3), or ``()``
    qk_norm: tuple[torch.Tensor, ...] = ()


@dataclass
class DecoderWeights:
    """All weights the engine reads. ``share=True`` references the model's tensors (no copy);
    otherwise the engine owns copies, with q/k/v and gate/up fused into single matrices."""

    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)
    share: bool = False

    @classmethod
    @torch.no_grad()
    def from_model(cls, model, dtype: torch.dtype, device: torch.device, share: bool) -> "DecoderWeights":
        inner = model.model
        embed = _param(effective_weight(inner.embed_tokens), dtype, device, share)
        tied = model.lm_head.weight is inner.embed_tokens.weight or (
            model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr())
        head = embed if tied else _param(effective_weight(model.lm_head), dtype, device, share)
        out = cls(embed=embed, norm=_param(inner.norm.weight, dtype, device, share), lm_head=head, share=share)
        for layer in inner.layers:
            out.layers.append(_layer_weights(layer, dtype, device, share))
        return out

    @torch.no_grad()
    def copy_from(self, model) -> None:
        """Refresh owned copies in place (addresses unchanged, so captured graphs stay valid)."""
        fresh = DecoderWeights.from_model(model, self.embed.dtype, self.embed.device, share=False)
        for mine, new in zip(self.tensors(), fresh.tensors()):
            if mine is not None and mine.data_ptr() != new.data_ptr():
                mine.copy_(new)

    def tensors(self) -> list[torch.Tensor | None]:
        out = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            out += [lw.ln1, lw.ln2, *lw.qkv, *lw.qkv_bias, lw.o, lw.o_bias, *lw.gate_up, *lw.gate_up_bias,
                    lw.down, lw.down_bias, *lw.qk_norm]
        return out

    def pointers(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors() if t is not None]


def _layer_weights(layer, dtype, device, share: bool) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = ()
    if getattr(attn, "q_norm", None) is not None:
        qk_norm = (_param(attn.q_norm.weight, dtype, device, share), _param(attn.k_norm.weight, dtype, device, share))
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    ups = [mlp.gate_proj, mlp.up_proj]
    if share:
        qkv = [p.weight.detach() for p in projs]
        qkv_bias = [_param(_bias(p), dtype, device, True) for p in projs]
        gate_up = [p.weight.detach() for p in ups]
        gate_up_bias = [_param(_bias(p), dtype, device, True) for p in ups]
    else:  # owned copies: LoRA layers contribute their weight with the adapters merged
        qkv = [_fused([effective_weight(p) for p in projs], dtype, device)]
        qkv_bias = [_fused([_bias(p) for p in projs], dtype, device)]
        gate_up = [_fused([effective_weight(p) for p in ups], dtype, device)]
        gate_up_bias = [_fused([_bias(p) for p in ups], dtype, device)]
    return LayerWeights(
        ln1=_param(layer.input_layernorm.weight, dtype, device, share),
        ln2=_param(layer.post_attention_layernorm.weight, dtype, device, share),
        qkv=qkv, qkv_bias=qkv_bias,
        o=_param(effective_weight(attn.o_proj), dtype, device, share),
        o_bias=_param(_bias(attn.o_proj), dtype, device, share),
        gate_up=gate_up, gate_up_bias=gate_up_bias,
        down=_param(effective_weight(mlp.down_proj), dtype, device, share),
        down_bias=_param(_bias(mlp.down_proj), dtype, device, share),
        qk_norm=qk_norm,
    )


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama defines it: normalise in float32, cast back, then scale. ``[..., H]``.

    Rounded as the Hugging Face model rounds it (the trainer's recomputation): the normalised
    value goes to the compute dtype before the weight multiplies it. ``F.rms_norm``'s fused kernel
    applies the weight before its single rounding, which in bf16 changes a quarter of the values by
    one unit in the last place once the weight is not all ones (a trained model's norms; Qwen3's
    per-head q/k norms), and moved the rollout's log-probs away from the trainer's. The compiled
    decode step keeps the two roundings too (``emulate_precision_casts``, see
    :func:`rlcore.rollout.engine.decode.step_functions`) and fuses them into one kernel."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == roll(x, D/2) * signed_sin``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout.

    ``x [..., D]``; ``cos`` and ``sin_signed`` (see :func:`signed_sin`) broadcast to it. Each
    product is rounded to the compute dtype before the sum, as the Hugging Face model rounds them
    (``addcmul`` would round once: in bf16 that alone moved sampled log-probs away from the
    trainer's recomputation by several times HF ``generate``'s gap)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def norm_heads(x: torch.Tensor, qk_norm: Sequence[torch.Tensor], heads: int, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of the queries and keys: ``x [..., H + KVH, D]`` (query heads, then
    key heads) with the first ``heads`` normed by ``qk_norm[0]`` and the rest by ``qk_norm[1]``;
    ``x`` itself when ``qk_norm`` is empty. Runs before RoPE, as the model does."""
    if not qk_norm:
        return x
    q, k = x.split([heads, x.shape[-2] - heads], dim=-2)
    return torch.cat((rms_norm(q, qk_norm[0], eps), rms_norm(k, qk_norm[1], eps)), dim=-2)


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """One projection, or several concatenated on the last dimension (unfused weights)."""
    if len(weights) == 1:
        return F.linear(x, weights[0], biases[0])
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + (x @ weight.T (+ bias))``, the product rounded to the compute dtype before the
    add, as the Hugging Face model computes it (the trainer's recomputation). ``[..., in] -> [..., out]``."""
    return residual + F.linear(x, weight, bias)


def mlp_residual(x: torch.Tensor, h: torch.Tensor, gate_up: Sequence[torch.Tensor],
                 gate_up_bias: Sequence[torch.Tensor | None], down: torch.Tensor,
                 down_bias: torch.Tensor | None) -> torch.Tensor:
    """``x + down(silu(gate(h)) * up(h))``; ``x, h [..., H]``."""
    gate, up = linear_group(h, gate_up, gate_up_bias).chunk(2, dim=-1)
    return residual_linear(x, F.silu(gate) * up, down, down_bias)


def _qkv(x: torch.Tensor, lw: LayerWeights, spec: DecoderSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = linear_group(x, lw.qkv, lw.qkv_bias)
    q_width = spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    return qkv.split([q_width, kv_width, kv_width], dim=-1)


# ----------------------------------------------------------------------------- passes

#: left-padded prompts at least this wide are prefilled with attention row by row, each row over its own
#: tokens (causal, no mask: the flash kernels), instead of one call under a ``[n, 1, P, P]`` mask, which at
#: thousands of columns is hundreds of megabytes a layer and keeps the kernels that take no mask out (the
#: prompts of a rollout's carried samples, ``ppo.partial_rollout``: their responses so far re-prefilled)
ROW_ATTENTION_WIDTH = 1024


def _row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pads: Sequence[int]) -> torch.Tensor:
    """Causal attention of each row over its own columns (``pads[i]`` left-padding columns cut off first);
    ``q, k, v [n, heads, P, D]``. The padding positions' outputs are zeros (never read: their keys and
    values stay masked in the cache)."""
    out = torch.zeros_like(q)
    for row, pad in enumerate(pads):
        out[row, :, pad:] = F.scaled_dot_product_attention(q[row, None, :, pad:], k[row, None, :, pad:],
                                                           v[row, None, :, pad:], is_causal=True)[0]
    return out


def _prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[n, P]`` left-padding mask -> ``[n, 1, P, P]`` bool: causal, valid keys only, and every
    query sees itself (padded queries would otherwise attend to nothing and give NaN)."""
    width = mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril_()
    allowed = causal[None] & mask.bool()[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool, device=mask.device)
    return allowed[:, None]


@torch.no_grad()
def prefill(weights: DecoderWeights, spec: DecoderSpec, cache: torch.Tensor, slots: torch.Tensor,
            ids: torch.Tensor, mask: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
            padded: bool = True) -> torch.Tensor:
    """Run left-padded prompts and write their keys/values to cache rows ``slots``.

    Args:
        cache: ``[L, 2, B, KVH, S, D]``; rows ``slots``, columns ``0..P-1`` are overwritten.
        slots: ``[n]`` int64 cache rows. ids, mask: ``[n, P]`` left-padded prompts.
        cos_table, sin_table: ``[S, D]`` float32 (``sin_table`` from :func:`signed_sin`).
        padded: ``False`` promises that ``mask`` is all ones (prompts of one length), so
            attention runs as plain causal attention (flash kernels) without a mask tensor. Padded
            prompts at least :data:`ROW_ATTENTION_WIDTH` wide attend row by row, each without a mask.
    Returns:
        ``[n, V]`` logits (compute dtype) of the last prompt position.
    """
    n, width = ids.shape
    dtype = weights.embed.dtype
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)
    cos = cos_table[positions].to(dtype)[:, :, None]  # [n, P, 1, D]
    sin = sin_table[positions].to(dtype)[:, :, None]
    by_row = padded and width >= ROW_ATTENTION_WIDTH
    pads = (width - mask.long().sum(-1)).tolist() if by_row else None
    allowed = _prefill_mask(mask) if padded and not by_row else None
    x = F.embedding(ids, weights.embed)
    for index, lw in enumerate(weights.layers):
        q, k, v = _qkv(rms_norm(x, lw.ln1, spec.rms_eps), lw, spec)
        q, k = q.view(n, width, heads, dim), k.view(n, width, kv_heads, dim)
        if lw.qk_norm:
            q, k = rms_norm(q, lw.qk_norm[0], spec.rms_eps), rms_norm(k, lw.qk_norm[1], spec.rms_eps)
        q = rotate(q, cos, sin).transpose(1, 2)
        k = rotate(k, cos, sin).transpose(1, 2)
        v = v.view(n, width, kv_heads, dim).transpose(1, 2)
        cache[index, 0, slots, :, :width] = k
        cache[index, 1, slots, :, :width] = v
        if spec.group > 1:
            k = k.repeat_interleave(spec.group, dim=1)
            v = v.repeat_interleave(spec.group, dim=1)
        if by_row:
            attn = _row_attention(q, k, v, pads)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None)
        x = residual_linear(x, attn.transpose(1, 2).reshape(n, width, heads * dim), lw.o, lw.o_bias)
        x = mlp_residual(x, rms_norm(x, lw.ln2, spec.rms_eps), lw.gate_up, lw.gate_up_bias, lw.down, lw.down_bias)
    last = rms_norm(x[:, -1], weights.norm, spec.rms_eps)
    return F.linear(last, weights.lm_head)


@torch.no_grad()
def extend(weights: DecoderWeights, spec: DecoderSpec, cache: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
           lengths: Sequence[int], columns: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor,
           cos_table: torch.Tensor, sin_table: torch.Tensor, length: int,
           table: torch.Tensor | None = None, attention: str = "sdpa", tuning: dict | None = None) -> torch.Tensor:
    """Append tokens to the sequences of several cache rows in one forward (ragged appends): row
    ``rows[i]`` gets ``ids[i, :lengths[i]]`` at cache columns ``columns[i]..`` and positions
    ``positions[i]..``, attending to its valid earlier columns (``bias`` 0) and causally to its own
    new tokens; their keys/values are written to the cache. The history is read from the cache,
    not recomputed (a multi-turn observation costs a prefill of its own tokens only).

    The projections and the MLP run on the packed new tokens (no padding); only the attention
    pads the queries of each row to the longest append.

    Args:
        cache: ``[L, 2, B, KVH, S, D]``, or with ``table`` (``[B, pages per row]`` int32) a pool of
            pages ``[L, 2, pages, KVH, page_size, D]``; the rows' pages must cover the new columns.
        rows: ``[m]`` int64 cache rows. ids: ``[m, K]`` token ids, right padded.
        lengths: host ints, the new tokens of each row (``1..K``).
        columns, positions: ``[m]`` int64, the first new column and RoPE position of each row.
        bias: ``[B, S]`` additive key mask; columns below ``columns[i]`` with 0 are row ``i``'s history.
        cos_table, sin_table: as for :func:`prefill`.
        length: the columns attended (at least every row's last new column + 1).
        attention: ``"triton"`` with ``table``: :func:`extend_tokens` (each new token attends as a query
            of the paged decode kernel, :func:`rlcore.kernels.decode_attention.attend`, with its row's
            pages and a key mask of its own: no gather of the rows' keys/values, no repeat of the
            key/value heads). Otherwise (``"sdpa"``) the rows' keys and
            values are gathered and one masked SDPA call runs per layer.
        tuning: the decode kernel's tuning (``attention="triton"``).
    Returns:
        ``[m, V]`` next-token logits (compute dtype) after the last new token of each row.
    """
    m, width = ids.shape
    dev = ids.device
    dtype = weights.embed.dtype
    counts = torch.tensor(list(lengths), dtype=torch.long)
    which = torch.repeat_interleave(torch.arange(m), counts)  # packed token -> its row (host, no device read)
    offset = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    which, offset = which.to(dev, non_blocking=True), offset.to(dev, non_blocking=True)
    last = (counts.cumsum(0) - 1).to(dev, non_blocking=True)
    cols = columns[which] + offset  # [T] cache column of each new token
    pos = positions[which] + offset
    # where each new token's key/value goes: (cache row, column) or (page, row in the page)
    at = (rows[which], cols) if table is None else (table[rows[which], cols // cache.shape[4]].long(),
                                                    cols % cache.shape[4])
    if attention == "triton" and table is not None:  # one query row per new token: its row's pages, its own key mask
        tokens = torch.stack([ids[which, offset], rows[which], cols, pos, columns[which], *at])
        hidden = extend_tokens(weights, spec, cache, table, tokens, last, bias, cos_table, sin_table, length, tuning)
        return F.linear(hidden, weights.lm_head)
    cos = cos_table[pos].to(dtype)[:, None]  # [T, 1, D]
    sin = sin_table[pos].to(dtype)[:, None]
    span = torch.arange(length, device=dev)
    # every query row: its row's history, and its own new columns up to itself (padded queries see
    # their row's first new column, so that no row of the mask is empty)
    step = torch.arange(width, device=dev)
    start = columns[:, None, None]
    allowed = (((bias[rows, :length] == 0)[:, None, :] & (span[None, None] < start))
               | ((span[None, None] >= start) & (span[None, None] <= start + step[None, :, None])))
    attend_new = functools.partial(_attend_gathered, rows=rows, table=table, length=length, width=width,
                                   which=which, offset=offset, allowed=allowed, spec=spec)
    x = _new_tokens(weights, spec, cache, F.embedding(ids[which, offset], weights.embed), cos, sin, at, attend_new)
    return F.linear(rms_norm(x[last], weights.norm, spec.rms_eps), weights.lm_head)


def _new_tokens(weights: DecoderWeights, spec: DecoderSpec, cache: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor], attend_new) -> torch.Tensor:
    """The layers over packed new tokens ``x [T, H]`` (RoPE ``cos``/``sin`` ``[T, 1, D]``): each token's
    key/value written at ``at`` (cache row and column, or page and row in the page), its attention
    from ``attend_new(q, layer)``. Returns the last layer's output ``[T, H]`` (before the final norm)."""
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    for index, lw in enumerate(weights.layers):
        q, key, value = _qkv(rms_norm(x, lw.ln1, spec.rms_eps), lw, spec)
        q, key = q.view(-1, heads, dim), key.view(-1, kv_heads, dim)
        if lw.qk_norm:
            q, key = rms_norm(q, lw.qk_norm[0], spec.rms_eps), rms_norm(key, lw.qk_norm[1], spec.rms_eps)
        q, key = rotate(q, cos, sin), rotate(key, cos, sin)
        layer = cache[index]
        layer[0, at[0], :, at[1]] = key
        layer[1, at[0], :, at[1]] = value.view(-1, kv_heads, dim)
        x = residual_linear(x, attend_new(q, layer), lw.o, lw.o_bias)
        x = mlp_residual(x, rms_norm(x, lw.ln2, spec.rms_eps), lw.gate_up, lw.gate_up_bias, lw.down, lw.down_bias)
    return x


#: rows of :func:`extend_tokens`' ``tokens`` argument
TOKEN_FIELDS = ("id", "row", "column", "position", "start", "page", "in_page")


@torch.no_grad()
def extend_tokens(weights: DecoderWeights, spec: DecoderSpec, cache: torch.Tensor, table: torch.Tensor,
                  tokens: torch.Tensor, last: torch.Tensor, bias: torch.Tensor, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, length: int, tuning: dict | None = None) -> torch.Tensor:
    """:func:`extend` over a paged cache with the Triton kernel, every input a device tensor of a fixed
    shape, nothing read back and nothing sized by values: the forward a CUDA graph can hold
    (:mod:`rlcore.rollout.engine.extend`).

    Args:
        tokens: ``[7, T]`` int64, per new token (rows named by :data:`TOKEN_FIELDS`): its id, its cache
            row, its cache column and RoPE position, the first new column of its row (columns before it
            are the row's history where ``bias`` is 0; from it up to the token's own column, its row's new
            tokens), and the page and row in the page its key/value go to. A padding token (id 0, row 0,
            column 0, start 0, the null page) attends to column 0 alone and writes to the null page.
        last: ``[M]`` int64, the index in ``tokens`` of each row's last new token (padding: any).
        bias: ``[B, S]`` the rows' key mask, already covering their new columns.
        length: the columns attended (at least every row's last new column + 1).
    Returns:
        ``[M, H]`` hidden states after the final norm at ``last`` (the caller applies the head).
    """
    ids, rows, cols, pos, start, page, in_page = tokens.unbind(0)
    dtype = weights.embed.dtype
    cos = cos_table[pos].to(dtype)[:, None]  # [T, 1, D]
    sin = sin_table[pos].to(dtype)[:, None]
    span = torch.arange(length, device=tokens.device)[None]
    allowed = (((bias[rows, :length] == 0) & (span < start[:, None]))
               | ((span >= start[:, None]) & (span <= cols[:, None])))
    attend_new = functools.partial(
        _attend_paged, table=table[rows], page_size=cache.shape[4], length=length, spec=spec,
        bias=torch.where(allowed, 0.0, float("-inf")).to(bias.dtype),
        tuning={k: v for k, v in (tuning or {}).items() if k != "rope_rows"})
    x = _new_tokens(weights, spec, cache, F.embedding(ids, weights.embed), cos, sin, (page, in_page), attend_new)
    return rms_norm(x[last], weights.norm, spec.rms_eps)


def _attend_paged(q: torch.Tensor, layer: torch.Tensor, *, table: torch.Tensor, page_size: int, length: int,
                  spec: DecoderSpec, bias: torch.Tensor, tuning: dict) -> torch.Tensor:
    """:func:`extend`'s attention through the paged decode kernel: new token ``t`` (``q [T, heads, D]``)
    reads the pages ``table[t]`` of its row under its own key mask ``bias[t]``. Returns ``[T, heads·D]``."""
    return attend(q.view(-1, spec.num_kv_heads, spec.group, spec.head_dim), layer, bias, length,
                  pages=(table, page_size), **tuning)


def _attend_gathered(q: torch.Tensor, layer: torch.Tensor, *, rows: torch.Tensor, table: torch.Tensor | None,
                     length: int, width: int, which: torch.Tensor, offset: torch.Tensor, allowed: torch.Tensor,
                     spec: DecoderSpec) -> torch.Tensor:
    """:func:`extend`'s attention with the rows' keys/values gathered (pages or cache rows, each key/value
    head repeated for its query heads) and the new tokens padded per row: one masked SDPA call."""
    heads, dim = spec.num_heads, spec.head_dim
    kv = layer[:, rows, :, :length] if table is None else gather_pages(layer, table[rows], len(rows), length)
    keys, values = kv[0], kv[1]
    if spec.group > 1:
        keys = keys.repeat_interleave(spec.group, dim=1)
        values = values.repeat_interleave(spec.group, dim=1)
    padded = q.new_zeros(len(rows), width, heads, dim)
    padded[which, offset] = q
    attn = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=allowed[:, None])
    return attn.transpose(1, 2)[which, offset].reshape(-1, heads * dim)

