"""The decode step: one new token for each of the first ``n`` cache slots.

A step is split around the attention of each layer into three functions of tensors:

* ``first`` — embedding lookup and the *head* of layer 0;
* ``middle`` — the *tail* of layer ``i`` and the head of layer ``i + 1`` (called ``L - 1`` times:
  every layer has the same shapes, so one compiled graph serves them all);
* ``last`` — the tail of the last layer, the final norm and the LM head;

where head = RMSNorm, fused q/k/v projection, (Qwen3) per-head q/k RMSNorm, RoPE; tail = o-projection + residual, RMSNorm,
SiLU-gated MLP + residual. Between them the eager part writes the new keys/values into the
static cache and attends over its filled columns. With the Triton attention kernel the head
stops at the projection (``rope_in_attention``): one kernel per layer then rotates the queries
and the new key, writes the new key/value to the cache and attends
(:func:`rlcore.kernels.decode_attention.attend_new`).

With ``torch.compile`` (:func:`step_functions` with a mode) Inductor fuses the pointwise work
of each piece (residual adds, the norms, RoPE, SiLU·mul, the key/value packing) into a few
kernels while the matrix products stay library GEMMs; the cache write, being an in-place
update of a large buffer, stays outside the compiled graphs. The engine captures the whole step
in a CUDA graph, so the compiled functions' Python guards cost nothing when it is replayed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rlcore.config.schema import AttentionKind, CompileMode
from rlcore.kernels import decode_attention
from rlcore.kernels import step_kernels
from rlcore.rollout.engine.llama import (DecoderSpec, DecoderWeights, LayerWeights, linear_group, norm_heads, rms_norm,
                                         rotate)

log = logging.getLogger(__name__)

ATTENTION_KINDS = tuple(kind for kind in AttentionKind.values() if kind != "auto")
COMPILE_MODES = CompileMode.values()


@dataclass
class DecodeState:
    """Per-slot device buffers the decode pass reads and advances (all ``[B]`` or ``[B, S]``).

    ``tokens``: last sampled token; ``positions``: its RoPE position; ``cache_index``: the cache
    column it is written to; ``bias``: additive key mask (0 valid, ``-inf`` not);
    ``flat_base``: ``[2, B, KVH]`` row of each slot's key and value heads in a layer's cache
    flattened to ``[2·B·KVH·S, D]``; ``attention_counters``: ``[B·KVH]`` int32 zeros for the Triton
    attention kernel's in-kernel merge of chunks (``None``: a buffer shared by the device's calls);
    ``share_source``, ``share_end``: ``[B]`` int32, the Triton attention kernel reads a slot's
    columns below ``share_end`` from cache row ``share_source`` (the samples of one prompt reading
    its keys/values at one place; ``None``: every slot reads its own row); ``share_active``: use
    them in this step (off when no prompt repeats); ``table``: ``[B, S / page_size]`` int32, with a
    paged cache the page of each slot's columns (``None``: the static cache), ``page_size`` its columns.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cache_index: torch.Tensor
    bias: torch.Tensor
    flat_base: torch.Tensor
    zero: torch.Tensor
    attention_counters: torch.Tensor | None = None
    share_source: torch.Tensor | None = None
    share_end: torch.Tensor | None = None
    share_active: bool = False
    table: torch.Tensor | None = None
    page_size: int = 0

    @classmethod
    def empty(cls, spec: DecoderSpec, slots: int, columns: int, dtype: torch.dtype, device: torch.device,
              table: torch.Tensor | None = None, page_size: int = 0, sharing: bool = False) -> "DecodeState":
        """The state of ``slots`` idle slots of ``columns`` cache columns each (``sharing``: with the
        prompt-sharing rows, every slot reading its own row)."""
        b, s, kv_heads = slots, columns, spec.num_kv_heads
        slot_rows = torch.arange(b, device=device)[:, None] * kv_heads
        state = cls(
            tokens=torch.zeros(b, dtype=torch.long, device=device),
            positions=torch.zeros(b, dtype=torch.long, device=device),
            cache_index=torch.zeros(b, dtype=torch.long, device=device),
            bias=torch.zeros(b, s, dtype=dtype, device=device),
            flat_base=((torch.arange(2, device=device)[:, None, None] * b * kv_heads + slot_rows[None]
                        + torch.arange(kv_heads, device=device)[None, None]) * s),
            zero=torch.zeros(1, 1, dtype=dtype, device=device),
            attention_counters=torch.zeros(b * kv_heads, dtype=torch.int32, device=device),
            table=table, page_size=page_size)
        if sharing:
            state.share_source = torch.arange(b, dtype=torch.int32, device=device)
            state.share_end = torch.zeros(b, dtype=torch.int32, device=device)
        return state


# ----------------------------------------------------------------------------- the pieces

def _project(x: torch.Tensor, ln1: torch.Tensor, qkv: tuple, qkv_bias: tuple, eps: float,
             splits: int = 1, parts: bool = False) -> torch.Tensor:
    """``x [n, H]`` -> the fused q/k/v projection ``[n, (heads + 2·kv_heads)·D]`` of ``norm(x)``.

    ``splits > 1`` (a fused matrix): the product over slices of the inner dimension (:func:`_partials`),
    summed here, or with ``parts`` returned as ``[splits, n, ·]`` without the bias, for the attention
    kernel to sum and add it (:func:`rlcore.kernels.decode_attention.attend_new`)."""
    h = rms_norm(x, ln1, eps)
    if splits == 1 or len(qkv) != 1:
        return linear_group(h, qkv, qkv_bias)
    if parts:  # summed (and rounded to the cache's dtype) by the attention kernel
        return _partials(h, qkv[0], None, splits)
    return _sum(_partials(h, qkv[0], qkv_bias[0], splits)).to(x.dtype)


def _head(x: torch.Tensor, ln1: torch.Tensor, qkv: tuple, qkv_bias: tuple, qk_norm: tuple, cos: torch.Tensor,
          sin: torch.Tensor, eps: float, heads: int, kv_heads: int, splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, H]`` -> ``(q [n, KVH, G, D], kv [2, n, KVH, D])`` with the per-head q/k norms
    ``qk_norm`` (Qwen3; ``()``: none) and then RoPE applied to q and k.

    ``cos``, ``sin`` ``[n, 1, D]`` (``sin`` signed, see :func:`rlcore.rollout.engine.llama.signed_sin`)."""
    n, dim = x.shape[0], cos.shape[-1]
    proj = _project(x, ln1, qkv, qkv_bias, eps, splits)
    qk = norm_heads(proj[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim), qk_norm, heads, eps)
    qk = rotate(qk, cos, sin)
    v = proj[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
    q = qk[:, :heads].reshape(n, kv_heads, heads // kv_heads, dim)
    return q, torch.stack((qk[:, heads:], v))


def _project_normed(x: torch.Tensor, ln1: torch.Tensor, qkv: tuple, qkv_bias: tuple, qk_norm: tuple, eps: float,
                    heads: int, kv_heads: int, splits: int = 1) -> torch.Tensor:
    """The projection the attention kernel reads when it applies RoPE (:func:`_project` with
    ``parts``), with the per-head q/k norms ``qk_norm`` (Qwen3) already applied: then one
    ``[n, (heads + 2·kv_heads)·D]`` tensor (the norm needs the summed projection, so no partial products)."""
    if not qk_norm:
        return _project(x, ln1, qkv, qkv_bias, eps, splits, parts=True)
    n = x.shape[0]
    proj = _project(x, ln1, qkv, qkv_bias, eps, splits)
    dim = qk_norm[0].shape[0]
    qk = norm_heads(proj[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim), qk_norm, heads, eps)
    return torch.cat((qk.view(n, -1), proj[:, (heads + kv_heads) * dim:]), dim=-1)


def _tail(x: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, o_bias, ln2: torch.Tensor, gate_up: tuple,
          gate_up_bias: tuple, down: torch.Tensor, down_bias, eps: float, split: tuple = (1, 1, 1),
          transposed: bool = False) -> torch.Tensor:
    """``x + o(attn)``, then ``+ mlp(norm(.))``; ``x [n, H]``, ``attn [n, heads·D]``.

    ``split``: how many slices of the inner dimension the o, gate/up and down products are cut
    into (see :func:`_partials`). ``transposed`` (a fused gate/up matrix): the gate/up product is
    taken as ``weight @ norm(x)^T`` (``[2·I, n]``: the library's tiles fit a tall output better at a
    few hundred rows), SiLU·mul runs on that layout and the down product reads it through strides."""
    x = _add(x, _partials(attn, o, o_bias, split[0]))
    h = rms_norm(x, ln2, eps)
    turned = transposed and len(gate_up) == 1
    if turned:
        gate_up_out = torch.mm(gate_up[0], h.t())  # [2·I, n]
        if gate_up_bias[0] is not None:
            gate_up_out = gate_up_out + gate_up_bias[0][:, None]
    elif len(gate_up) == 1 and split[1] > 1:
        gate_up_out = _sum(_partials(h, gate_up[0], gate_up_bias[0], split[1]))
    else:
        gate_up_out = linear_group(h, gate_up, gate_up_bias)
    gate, up = gate_up_out.chunk(2, dim=0 if turned else -1)
    act = (F.silu(gate) * up).to(x.dtype)
    return _add(x, _partials(act.t() if turned else act, down, down_bias, split[2]))  # [n, I], maybe stored [I, n]


def _partials(x: torch.Tensor, weight: torch.Tensor, bias, splits: int, exact: bool = True) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as ``[splits, n, out]`` partial products over equal slices of the
    inner dimension, to be summed by the kernel that reads them (split-K without a reduction kernel).

    At a few hundred rows the narrow decode products (o, down) have too few output tiles to fill
    the GPU; one batched product over the slices gives it ``splits`` times as many. ``exact`` (on
    CUDA, bf16/fp16, where :data:`FLOAT32_PARTIALS`): the partials stay float32 (the library's accumulator, not rounded), so their
    sum is rounded once, as the Hugging Face model rounds its one product; partials rounded to the
    compute dtype each add their own rounding and moved the rollout's log-probs away from the
    trainer's recomputation."""
    n, inner = x.shape
    if splits == 1 or inner % splits:
        return F.linear(x, weight, bias)[None]
    width = inner // splits
    if x.stride(0) == 1 and n > 1:  # stored transposed ([inner, n]): slice its rows
        slices = x.t().reshape(splits, width, n).transpose(1, 2)
    else:
        slices = x.view(n, splits, width).transpose(0, 1)
    mats = weight.view(-1, splits, width).permute(1, 2, 0)
    if exact and slices.is_cuda and slices.dtype in (torch.bfloat16, torch.float16) and FLOAT32_PARTIALS:
        out = torch.bmm(slices, mats, out_dtype=torch.float32)
    else:
        out = torch.bmm(slices, mats)
    if bias is not None:
        out[0] += bias
    return out


#: whether this torch computes a bf16/fp16 batched product into float32 on CUDA (``torch.bmm(...,
#: out_dtype=torch.float32)``); set by :func:`probe_float32_partials` when an engine is built on CUDA
FLOAT32_PARTIALS = False


def probe_float32_partials(device: torch.device) -> bool:
    """Check once, outside any compiled code, that ``torch.bmm`` takes ``out_dtype`` on ``device``; sets
    :data:`FLOAT32_PARTIALS` (older torch: the partials stay in the compute dtype)."""
    global FLOAT32_PARTIALS
    device = torch.device(device)
    if device.type != "cuda" or FLOAT32_PARTIALS:
        return FLOAT32_PARTIALS
    try:
        a = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        FLOAT32_PARTIALS = torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        FLOAT32_PARTIALS = False
    return FLOAT32_PARTIALS


def _add(residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``residual + out.sum(0)``; ``out`` ``[splits, n, H]``. The product is rounded to the compute
    dtype before the add, as the Hugging Face model rounds its projection before its residual add
    (rounding the sum once moved the rollout's log-probs away from the trainer's recomputation).
    A pointwise add the compiler fuses into the next RMSNorm kernel (not an ``addmm``, whose
    library kernel first copies the residual into its output)."""
    return residual + _sum(out).to(residual.dtype)


def _sum(parts: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """``start + parts.sum(0)`` in float32, as a chain of adds: pointwise work the compiler fuses
    into the kernel that reads the result (a ``sum`` over the first dimension would be a reduction
    kernel of its own, which the next RMSNorm, reducing over another dimension, cannot absorb)."""
    total = start
    for part in parts.unbind(0):
        total = part.float() if total is None else total + part.float()
    return total


def head_args(lw: LayerWeights) -> tuple:
    return lw.ln1, tuple(lw.qkv), tuple(lw.qkv_bias), tuple(lw.qk_norm)


def tail_args(lw: LayerWeights) -> tuple:
    return lw.o, lw.o_bias, lw.ln2, tuple(lw.gate_up), tuple(lw.gate_up_bias), lw.down, lw.down_bias


@dataclass(frozen=True)
class StepFunctions:
    """The three pieces of a step (see the module docstring), plain or compiled.

    With ``rope_in_attention`` the head of a layer stops at the q/k/v projection: RoPE and the
    cache write happen in the attention kernel (:func:`rlcore.kernels.decode_attention.attend_new`).
    """

    first: Callable
    middle: Callable
    last: Callable
    compiled: bool
    spec: DecoderSpec
    rope_in_attention: bool = False
    qkv_parts: bool = False  # the head's projection is [splits, n, ·] partial products without the bias
    # (never with q/k norms: they need the summed projection)


SPLIT_K_KEYS = ("o", "gate_up", "down", "qkv")
#: the engine's default on CUDA: at a few hundred rows the o, down and q/k/v products have too few
#: output tiles for the GPU; gate/up, already wide, is not split (measured: docs/benchmarks.md,
#: "Settings chosen by measurement")
AUTO_SPLIT_K = {"o": 2, "down": 4, "qkv": 2}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _power_of_two(value) -> bool:
    return _positive_int(value) and value & (value - 1) == 0


def check_options(name: str, options, rules: dict, shape: str = "a mapping") -> dict:
    """``options`` (a mapping or ``None``) as a dict, every key in ``rules`` (key ->
    ``(what a value must be, test)``) and every value passing its test; a ``ValueError`` names
    the first option that does not."""
    if options is None:
        return {}
    if not hasattr(options, "items"):
        raise ValueError(f"rollout engine: {name} must be {shape}, got {options!r}")
    unknown = sorted(set(options) - set(rules))
    if unknown:
        raise ValueError(f"rollout engine: {name} keys {unknown} are not among {tuple(rules)}")
    for key, value in options.items():
        expected, test = rules[key]
        if not test(value):
            raise ValueError(f"rollout engine: {name}[{key!r}] must be {expected}, got {value!r}")
    return dict(options)


_SPLIT_K_RULES = {key: ("a positive integer", _positive_int) for key in SPLIT_K_KEYS}


def split_k_tuple(split_k: dict | None) -> tuple[int, int, int, int]:
    """``{"o": 2, "down": 4}`` -> ``(2, 1, 4, 1)`` (the order of :data:`SPLIT_K_KEYS`); checks keys and values."""
    split_k = check_options("split_k", split_k, _SPLIT_K_RULES, f"'auto', None or a mapping like {AUTO_SPLIT_K}")
    return tuple(split_k.get(key, 1) for key in SPLIT_K_KEYS)


def step_functions(spec: DecoderSpec, compile_mode: str | None = None, rope_in_attention: bool = False,
                   split_k: tuple[int, ...] = (1, 1, 1, 1), mlp_transposed: bool = False) -> StepFunctions:
    """The step pieces for ``spec``, compiled with ``torch.compile(mode=compile_mode)`` unless ``None``.

    ``split_k``: slices of the inner dimension for the o, gate/up, down and q/k/v products
    (:func:`_partials`; with ``rope_in_attention`` the attention kernel adds the q/k/v slices and the
    bias, unless the model norms its queries and keys: then the head sums them and applies the norms).
    ``mlp_transposed``: the gate/up product as ``weight @ norm(x)^T`` (see :func:`_tail`).

    Compilation is lazy (first call); the caller falls back to the plain pieces if it raises.
    The model constants are closed over, so each model shape gets its own compiled graphs.
    """
    eps, heads, kv_heads = spec.rms_eps, spec.num_heads, spec.num_kv_heads
    split = tuple(split_k)
    qkv_split, turned = split[3], bool(mlp_transposed)

    # first: (tokens, positions, tables, embed, layer 0 head weights) -> (x, head, rope);
    # middle: (x, attn, rope, layer i tail weights, layer i+1 head weights) -> (x, head).
    # head is (q, kv) with RoPE applied, or (projection,) for the attention kernel to rotate.
    # The head weights are (ln1, qkv, qkv_bias, qk_norm), qk_norm () unless the model has q/k norms.
    def first(tokens, positions, cos_table, sin_table, embed, ln1, qkv, qkv_bias, qk_norm):
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
        x = F.embedding(tokens, embed)
        return x, _head(x, ln1, qkv, qkv_bias, qk_norm, cos, sin, eps, heads, kv_heads, qkv_split), (cos, sin)

    def middle(x, attn, rope, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias, ln1, qkv, qkv_bias, qk_norm):
        x = _tail(x, attn, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias, eps, split, turned)
        return x, _head(x, ln1, qkv, qkv_bias, qk_norm, *rope, eps, heads, kv_heads, qkv_split)

    def first_projected(tokens, positions, cos_table, sin_table, embed, ln1, qkv, qkv_bias, qk_norm):
        x = F.embedding(tokens, embed)
        return x, (_project_normed(x, ln1, qkv, qkv_bias, qk_norm, eps, heads, kv_heads, qkv_split),), ()

    def middle_projected(x, attn, rope, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias, ln1, qkv, qkv_bias,
                         qk_norm):
        x = _tail(x, attn, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias, eps, split, turned)
        return x, (_project_normed(x, ln1, qkv, qkv_bias, qk_norm, eps, heads, kv_heads, qkv_split),)

    def last(x, attn, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias, norm, lm_head):
        x = _tail(x, attn, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias, eps, split, turned)
        return F.linear(rms_norm(x, norm, eps), lm_head)

    if rope_in_attention:
        first, middle = first_projected, middle_projected
    parts = bool(rope_in_attention and qkv_split > 1 and not spec.qk_norm)
    if compile_mode is None:
        return StepFunctions(first, middle, last, compiled=False, spec=spec, rope_in_attention=rope_in_attention,
                             qkv_parts=parts)
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"rollout engine: compile_mode {compile_mode!r} is not one of {COMPILE_MODES}")
    _raise_recompile_limit(64)
    options = dict(fullgraph=True, options=compile_options(compile_mode))
    return StepFunctions(torch.compile(first, **options), torch.compile(middle, **options),
                         torch.compile(last, **options), compiled=True, spec=spec,
                         rope_in_attention=rope_in_attention, qkv_parts=parts)


def compile_options(compile_mode: str) -> dict:
    """Inductor options of the compiled step: those of ``compile_mode`` plus
    ``emulate_precision_casts``, so a fused kernel still rounds to the compute dtype wherever the
    eager code does (the residual adds, RoPE's products, RMSNorm before its weight). Without it
    Inductor keeps such intermediates in float32, a last-bit difference from the Hugging Face
    model that the trainer recomputes the log-probs with."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(compile_mode))
    if hasattr(inductor_config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = True
    return options


def _raise_recompile_limit(at_least: int) -> None:
    """Every (model shape, batch bucket) compiles its own graphs; keep torch from giving up early."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < at_least:
            setattr(config, name, at_least)


def mark_static(tensors) -> None:
    """Tell the compiler these tensors' shapes never change (no dynamic-shape kernels for weights)."""
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.mark_static(tensor)


# ----------------------------------------------------------------------------- attention

_ATTENTION_TUNING_RULES = {
    "block_n": ("a power of two >= 16", lambda value: _power_of_two(value) and value >= 16),
    "max_chunk": ("a non-negative integer (0: no cap)",
                  lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0),
    "num_warps": ("a power of two <= 32", lambda value: _power_of_two(value) and value <= 32),
    "num_stages": ("a positive integer", _positive_int),
    "rope_rows": ("True or False", lambda value: isinstance(value, bool)),
    "splits": ("a positive integer", _positive_int),
    "subblocks": ("a power of two", _power_of_two),
}
#: settings of the Triton attention kernel a caller may tune (see :func:`check_attention_tuning`)
ATTENTION_TUNING_KEYS = tuple(_ATTENTION_TUNING_RULES)


def check_attention_tuning(tuning) -> dict:
    """``tuning`` as a dict after checking it (:data:`ATTENTION_TUNING_KEYS`): the Triton kernel's
    ``block_n``, ``num_warps``, ``num_stages``, ``splits`` (chunks per slot and key/value head; default:
    :func:`rlcore.kernels.decode_attention.plan`'s rule), ``max_chunk`` (the most columns one program attends,
    default :data:`rlcore.kernels.decode_attention.MAX_CHUNK`, 0: no cap) and ``subblocks`` (softmax states per block, default 1;
    see :func:`rlcore.kernels.decode_attention.attend`), and
    ``rope_rows`` (default ``True``): with RoPE in the attention kernel, gather each slot's RoPE rows once a
    step instead of looking up its position in every layer's kernel (one dependent load less a layer)."""
    return check_options("attention_tuning", tuning, _ATTENTION_TUNING_RULES)


def attend(q: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int, kind: str,
           tuning: dict | None = None, pages: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Grouped-query attention of one new token per slot over cache columns ``0..length-1``.

    Args:
        q: ``[n, KVH, G, D]`` queries (the ``G`` query heads sharing a key/value head are laid out
            as ``G`` query rows, so no key/value head is repeated).
        layer: ``[2, B, KVH, S, D]`` one layer's cache (rows ``0..n-1`` are read).
        bias: ``[n, S]`` additive key mask; every row must have a valid column below ``length``.
        kind: ``"sdpa"`` (one fused attention kernel) or ``"triton"`` (:mod:`rlcore.kernels.decode_attention`:
            reads each key/value block once for the ``G`` query rows, needs CUDA or Triton's interpreter).
        pages: ``(table, page_size)`` for a paged cache (``layer`` ``[2, pages, KVH, page_size, D]``,
            see :func:`rlcore.kernels.decode_attention.attend`); sdpa gathers the pages first.
    Returns:
        ``[n, KVH·G·D]``.
    """
    if kind == "triton":
        return decode_attention.attend(q, layer, bias, length, pages=pages, **(tuning or {}))
    n = q.shape[0]
    if pages is not None:
        layer = decode_attention.gather_pages(layer, pages[0], n, length)
    keys, values = layer[0, :n, :, :length], layer[1, :n, :, :length]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None, :length])
    return out.reshape(n, -1)


# ----------------------------------------------------------------------------- the step

@torch.no_grad()
def decode(weights: DecoderWeights, cache: torch.Tensor, state: DecodeState, n: int, length: int,
           cos_table: torch.Tensor, sin_table: torch.Tensor, fns: StepFunctions,
           attention: str = "sdpa", attention_tuning: dict | None = None) -> torch.Tensor:
    """One decode step for slots ``0..n-1``; no host synchronisation, fixed shapes.

    Writes each slot's key/value at its ``cache_index``, marks it valid in ``bias``, attends over
    columns ``0..length-1`` (``length`` must exceed every live slot's ``cache_index``), advances
    ``positions`` and ``cache_index`` (clamped to ``S-1`` so idle slots stay in bounds).

    Args:
        cache: ``[L, 2, B, KVH, S, D]``, or with ``state.table`` a pool of pages ``[L, 2, pages, KVH,
            page_size, D]``. cos_table, sin_table: ``[S, D]`` (``sin_table`` signed), in
            the compute dtype for the separate RoPE, any float dtype for ``fns.rope_in_attention``
            (which needs ``attention="triton"``). fns: :func:`step_functions`.
        attention_tuning: for ``attention="triton"``, see :func:`check_attention_tuning`.
    Returns:
        ``[n, V]`` next-token logits in the compute dtype.
    """
    last_column = state.bias.shape[1] - 1
    pages = (state.table, state.page_size) if state.table is not None else None
    positions, cache_index = state.positions[:n], state.cache_index[:n]
    bias = state.bias[:n]
    tuning = dict(attention_tuning or {})
    rope_rows = tuning.pop("rope_rows", True)
    # with RoPE rows: mark the new columns valid, gather the rows and advance the slots at the start
    # (one kernel where Triton runs)
    rows_first = fns.rope_in_attention and rope_rows
    if rows_first:
        begin = step_kernels.begin_step if step_kernels.available(cache.device) else step_kernels.begin_step_reference
        cos_rows, sin_rows, columns = begin(cos_table, sin_table, positions, cache_index, state.bias, last_column)
    else:
        bias.scatter_(1, cache_index[:, None], state.zero.expand(n, 1))
        columns = cache_index
    if attention == "triton" and state.attention_counters is not None:
        tuning["counters"] = state.attention_counters
    if attention == "triton" and state.share_active:
        tuning["shared"] = (state.share_source[:n], state.share_end[:n])
    if fns.rope_in_attention:
        spec = fns.spec
        # the same RoPE rows serve every layer (gathered once), or each layer's kernel looks the position up
        rotary = (cos_rows, sin_rows, None) if rows_first else (cos_table, sin_table, positions)

        def attend_layer(layer, head, lw):
            # q/k/v slices come without the bias: the kernel adds both
            proj_bias = lw.qkv_bias[0] if fns.qkv_parts and len(lw.qkv) == 1 else None
            return decode_attention.attend_new(head[0], layer, bias, length, *rotary, columns, spec.num_heads,
                                               spec.num_kv_heads, proj_bias=proj_bias, pages=pages, **tuning)
    else:
        dim = cache.shape[-1]
        if pages is None:
            flat = (state.flat_base[:, :n] + cache_index[None, :, None]).reshape(-1)  # [2*n*KVH]
        else:  # row of each slot's new column in its page, for keys and values of every head
            count, kv_heads, size = cache.shape[2], cache.shape[3], state.page_size
            page = state.table[:n].gather(1, (cache_index // size)[:, None]).long()  # [n, 1]
            heads = torch.arange(kv_heads, device=cache.device)[None, None]
            halves = torch.arange(2, device=cache.device)[:, None, None]
            flat = (((halves * count + page[None]) * kv_heads + heads) * size
                    + (cache_index % size)[None, :, None]).reshape(-1)

        def attend_layer(layer, head, lw):
            q, kv = head
            layer.view(-1, dim).index_copy_(0, flat, kv.view(-1, dim))
            return attend(q, layer, bias, length, attention, tuning, pages)

    layers = weights.layers
    x, head, rope = fns.first(state.tokens[:n], positions, cos_table, sin_table, weights.embed,
                              *head_args(layers[0]))
    for index, lw in enumerate(layers):
        attn = attend_layer(cache[index], head, lw)  # cache[index]: [2, B, KVH, S, D]
        if index + 1 < len(layers):
            x, head = fns.middle(x, attn, rope, *tail_args(lw), *head_args(layers[index + 1]))
        else:
            logits = fns.last(x, attn, *tail_args(lw), weights.norm, weights.lm_head)
    if not rows_first:
        positions.add_(1).clamp_(max=last_column)
        cache_index.add_(1).clamp_(max=last_column)
    return logits

