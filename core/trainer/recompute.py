"""Activation checkpointing chosen per micro-batch by memory (``<role>.gradient_checkpointing=auto``).

Checkpointing (recomputing each decoder layer's activations in the backward pass) saves memory and
costs about a third more compute. With ``auto`` a micro-batch recomputes only when the estimated
activation memory of its forward (:func:`activation_bytes_per_token` x its tokens) exceeds the
memory free at that moment: the free memory of the device plus what PyTorch's caching allocator
holds unused (CUDA), the available physical memory (CPU); and, once the rate is measured (below),
only in as many decoder layers as it takes to fit (the first ones; :meth:`Recompute.layers_needed`),
so a micro-batch a little too large for the memory recomputes a little, not a third. Short micro-batches run at full speed,
long ones fit. ``true``/``false`` keep checkpointing on/off for every layer of every micro-batch.

The estimate from the model's shape is a planning figure (it counts every saved tensor as if none
were shared or freed early: 3.2 MB a token at 1.5B with the logits row, where a 32,768-token
micro-batch without checkpointing peaked at 97 GB, weights included: at most 3.0 MB a token). On CUDA each micro-batch that
runs without checkpointing measures what its forward and backward added at their peak
(:func:`rlcore.observe.peak.window`, the run's peak kept); from the largest such micro-batch on
(at least :data:`MEASURE_MIN_TOKENS` tokens), that figure per token, times :data:`MARGIN`, replaces
the estimate. It is measured, so it counts what the estimate misses as well (the gradients' first
allocation, the fused head's chunk), and the decisions after it recompute only what does not fit.

What a checkpointed layer recomputes is the role's ``gradient_checkpointing_policy``: ``full`` (its
whole forward) or ``selective`` (:func:`selective_contexts`: the outputs of its matrix products and
attention are kept and only the pointwise work between them is recomputed, about half the memory of
no checkpointing for a few percent more compute; under ``auto`` the token budget is then lowered to
what fits that way, so a micro-batch either runs without checkpointing or fits checkpointed).

The switch is the ``gradient_checkpointing`` flag of Hugging Face decoder layers
(``GradientCheckpointingLayer``), read at every forward; a model without such layers cannot be
switched per micro-batch and trains without checkpointing under ``auto`` (logged).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Iterator, NamedTuple

import torch

from rlcore.observe import peak
from rlcore.shape import decoder_shape

log = logging.getLogger(__name__)

#: Share of the free memory a micro-batch's activations may take before checkpointing turns on.
FREE_SHARE = 0.9
#: The smallest token budget :meth:`Recompute.token_budget` lowers a micro-batch to (below it,
#: checkpointing the larger one is the better trade).
MIN_BUDGET = 4096
#: Measured bytes per token are used only from micro-batches of at least this many tokens (fixed
#: costs spread over fewer tokens would overstate the rate).
MEASURE_MIN_TOKENS = 2048
#: Headroom on a measured rate (allocator rounding, a longer micro-batch's attention buffers).
MARGIN = 1.15
#: Share of the usable memory a micro-batch that checkpoints only some of its layers plans to fill: such a
#: plan has none of the slack that checkpointing every layer leaves, and the free memory counts the
#: allocator's unused blocks, which fragmentation may keep from serving one large request (measured on an
#: H100: a 1.5B reasoning update planned at the whole share from the shape's estimate ran out of memory
#: with 7.95 GB unused in the cache; partial plans now also wait for a measured rate)
PARTIAL_SHARE = 0.75

#: Operations whose outputs selective checkpointing keeps (the matrix products and attention): the
#: rest of a checkpointed layer (norms, RoPE, SiLU·mul, residual adds) is recomputed in the backward.
_KEPT_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))


#: the flash-attn package's forward operators (``attn_implementation=flash_attention_2``), kept as well
_KEPT_EXTERNAL = ("flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward")


def _keep_products(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in _KEPT_OPS
    if not keep and callable(getattr(op, "name", None)):
        keep = op.name() in _KEPT_EXTERNAL
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for selective checkpointing (one
    function, so compiled layers see the same policy every time): the outputs of :data:`_KEPT_OPS`
    are saved, everything else recomputed."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_products)


class _Dims(NamedTuple):
    """A decoder config's sizes (Hugging Face names, GPT-2 names as fallbacks) and bytes an element."""

    hidden: int
    layers: int
    inter: int
    kv: int  # key/value heads x head dim
    vocab: int
    elt: int


def _dims(config: Any, dtype: torch.dtype) -> _Dims:
    shape = decoder_shape(config)
    # a config naming no heads: one head as wide as the model
    kv = shape.kv if shape.heads else shape.hidden
    return _Dims(hidden=shape.hidden, layers=shape.layers, inter=shape.inter, kv=kv, vocab=shape.vocab,
                 elt=torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4)


def selective_bytes_per_token(config: Any, dtype: torch.dtype, logits: bool = True) -> int:
    """Estimated activation bytes a token keeps with selective checkpointing: per layer its input,
    the q/k/v, attention, o, gate, up and down products' outputs (``5 h + 2 kv + 2 i`` elements,
    the attention's log-sum-exp left out), plus the logits row as :func:`activation_bytes_per_token`."""
    d = _dims(config, dtype)
    return d.layers * (5 * d.hidden + 2 * d.kv + 2 * d.inter) * d.elt + (d.vocab * d.elt if logits else 0)


def activation_bytes_per_token(config: Any, dtype: torch.dtype, logits: bool = True) -> int:
    """Estimated bytes of activations one token keeps for the backward pass, without checkpointing.

    Per decoder layer: the layer input, both norms' outputs, the query, key and value, the
    attention output and the output projection's input (``6 h + 2 kv`` elements with the norms'
    float32 copies counted as ``2 h`` more float32), and the gated MLP's gate, up, activation and
    product (``4 i``); then one row of logits (``logits=False``: none, the head fused with the
    log-softmax, :mod:`rlcore.kernels.linear_logprob`, holds a bounded chunk). Memory-efficient attention (flash, SDPA) keeps no
    ``[T, T]`` scores, so none are counted. A planning estimate, not an exact count.
    """
    d = _dims(config, dtype)
    per_layer = (6 * d.hidden + 2 * d.kv + 4 * d.inter) * d.elt + (2 * d.hidden * 4 if d.elt < 4 else 0)
    return d.layers * per_layer + (d.vocab * d.elt if logits else 0)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can use now on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached))
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: assume plenty


def switchable_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Hugging Face decoder layers of ``model`` whose checkpointing can be switched per forward."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class Recompute:
    """The activation-checkpointing policy of one trained role (``true`` | ``false`` | ``auto``).

    :param model: the role's module, with checkpointing already enabled for ``true`` and ``auto``
        (:func:`rlcore.distributed.fsdp.enable_gradient_checkpointing`).
    :param setting: the role's ``gradient_checkpointing`` value.
    :param config: the model config (for :func:`activation_bytes_per_token`).
    :param device: where the role trains.
    :param logits: whether the role's forwards hold a row of logits per token (not with the fused head).
    :param selective: a checkpointed layer keeps its products' outputs (``<role>.gradient_checkpointing_policy
        =selective``, enabled with :func:`selective_contexts`); under ``auto`` the token budget is then
        lowered to what fits that way.
    :param partial: under ``auto``, a micro-batch that does not fit checkpoints only the layers it needs
        to (:meth:`layers_needed`); False: every layer.
    """

    def __init__(self, model: torch.nn.Module, setting: Any, config: Any, device: torch.device, role: str = "actor",
                 logits: bool = True, selective: bool = False, partial: bool = True):
        self.role = role
        self.auto = str(setting).lower() == "auto"
        self.device = torch.device(device)
        self.layers = switchable_layers(model) if self.auto else []
        self.params = [p for p in model.parameters() if p.requires_grad] if self.auto else []
        if self.auto and not self.layers:
            log.info("%s.gradient_checkpointing=auto: %s has no switchable decoder layers; training without "
                     "activation checkpointing", role, type(model).__name__)
            self.auto = False
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.estimated_bytes_per_token = activation_bytes_per_token(config, dtype, logits)
        self.selective = bool(selective)
        #: share of a token's activation bytes a selectively checkpointed micro-batch keeps (0 with full
        #: checkpointing: each layer's input only, not counted)
        self.kept_share = (selective_bytes_per_token(config, dtype, logits) / max(1, self.estimated_bytes_per_token)
                           if self.selective else 0.0)
        self.measured_tokens = 0  # tokens of the largest micro-batch measured so far (0: none)
        self.measured_bytes_per_token = 0.0
        #: budgets are lowered with the fused head (no logits row a token) or selective checkpointing: with the
        #: logits head and full checkpointing, smaller micro-batches measured slower than checkpointing the large
        #: ones (docs/benchmarks.md)
        self.lowers_budget = not logits or self.selective
        #: share of the estimated rate that the decoder layers hold (the rest: the logits row), the part
        #: checkpointing a layer can give back
        dims = _dims(config, dtype)
        layer_bytes = activation_bytes_per_token(config, dtype, logits=False)
        self.layer_share = layer_bytes / max(1, self.estimated_bytes_per_token) if dims.layers else 1.0
        #: checkpoint only as many layers as a micro-batch needs (False: all of them or none)
        self.partial = bool(partial)
        self.decisions: list[float] = []
        #: gradient accumulations into the trained parameters so far (a hook on each, under ``auto``): tells
        #: whether a micro-batch that ran out of memory added to ``.grad`` (:meth:`retry_after_oom`)
        self.accumulations = 0
        self.oom_retries = 0
        self.oom_tokens = 0  # the smallest micro-batch that ran out of memory (0: none)
        #: the hooks see every accumulation only where autograd adds to plain parameters (a sharding
        #: wrapper, e.g. FSDP2's DTensors, writes .grad itself): retries only then
        self.retriable = not any(hasattr(p, "_local_tensor") for p in self.params)
        if self.auto:
            self._set(0)
            for param in self.params:
                param.register_post_accumulate_grad_hook(self._accumulated)

    def _set(self, count: int) -> None:
        """Checkpointing on in the first ``count`` switchable layers, off in the others."""
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = i < count

    @property
    def bytes_per_token(self) -> float:
        """Activation bytes a token is planned at: measured (times :data:`MARGIN`) once a micro-batch of
        at least :data:`MEASURE_MIN_TOKENS` ran without checkpointing, the shape's estimate before."""
        if self.measured_tokens:
            return self.measured_bytes_per_token * MARGIN
        return float(self.estimated_bytes_per_token)

    def observe(self, tokens: int, added_bytes: int) -> None:
        """Record that a micro-batch of ``tokens`` tokens, without checkpointing, added ``added_bytes`` at
        its peak; the largest such micro-batch (ties: the higher rate) sets :attr:`bytes_per_token`."""
        if tokens < MEASURE_MIN_TOKENS or added_bytes <= 0 or tokens < self.measured_tokens:
            return
        rate = added_bytes / tokens
        if tokens == self.measured_tokens and rate <= self.measured_bytes_per_token:
            return
        if not self.measured_tokens:
            log.info("%s.gradient_checkpointing=auto: measured %.2f MB of activations a token (%d tokens without "
                     "checkpointing), against %.2f MB estimated from the model's shape", self.role, rate / 1e6,
                     tokens, self.estimated_bytes_per_token / 1e6)
        self.measured_tokens, self.measured_bytes_per_token = int(tokens), float(rate)

    def usable_bytes(self) -> float:
        """Memory a micro-batch's activations may take now: :data:`FREE_SHARE` of the free memory, less the
        gradients its backward will allocate (the trained parameters without a ``.grad`` yet: the first
        micro-batch after the optimizer step cleared them)."""
        pending = 0
        for param in self.params:
            if param.grad is None:
                local = getattr(param, "_local_tensor", param)  # a DTensor's shard on this rank
                pending += local.numel() * local.element_size()
        return FREE_SHARE * free_bytes(self.device) - pending

    def needed(self, tokens: int) -> bool:
        """Whether a micro-batch of ``tokens`` tokens should recompute (its activations would not fit)."""
        return self.layers_needed(tokens) > 0

    def layers_needed(self, tokens: int) -> int:
        """How many of the switchable layers a micro-batch of ``tokens`` tokens checkpoints: none when its
        activations fit in :meth:`usable_bytes`; else, once a micro-batch measured the rate
        (:meth:`observe`), the fewest whose checkpointing brings them within :data:`PARTIAL_SHARE` of it
        (each layer gives back its share of the decoder layers' bytes, less what selective checkpointing
        keeps: :attr:`kept_share`); all of them while the rate is the shape's estimate, where that is not
        enough, or with ``partial`` off."""
        total = len(self.layers)
        need = tokens * self.bytes_per_token
        usable = self.usable_bytes()
        if self.oom_tokens and tokens >= self.oom_tokens and total:
            return total
        if need <= usable or not total:
            return 0
        freed = need * self.layer_share * (1.0 - self.kept_share) / total
        # a partial plan needs the measured rate (it counts the head's backward and what the shape's
        # estimate misses) and fills only a share of the usable memory
        if not self.partial or not self.measured_tokens or freed <= 0:
            return total
        return min(total, math.ceil((need - PARTIAL_SHARE * usable) / freed))

    def token_budget(self, budget: int) -> int:
        """``ppo.max_tokens_per_micro_batch`` as this role trains it: under ``auto`` with the fused head
        (``logits=False``), lowered (to a multiple of 8, not under :data:`MIN_BUDGET`) to the tokens whose
        activations fit in the free memory now (at :attr:`bytes_per_token`: the shape's estimate until a
        micro-batch measured it); with selective checkpointing, to the tokens that fit checkpointed that
        way (:attr:`kept_share` of that rate); ``budget`` as given otherwise (and when even the floor would
        not fit). With the logits head and full checkpointing the budget stays: on an H100 the 1.5B
        reasoning update lowered to 10,784-token micro-batches ran 17.4 s (plus a recompile) against
        12.9 s checkpointing 32,768-token ones."""
        if not self.auto or not self.lowers_budget or budget <= 0:
            return budget
        # selective: what fits with the products' outputs kept (such a micro-batch checkpoints); else without
        rate = self.bytes_per_token * (self.kept_share if self.selective else 1.0)
        fits = int(max(0.0, self.usable_bytes()) // max(1.0, rate)) // 8 * 8
        return max(MIN_BUDGET, fits) if MIN_BUDGET <= fits < budget else budget

    @contextlib.contextmanager
    def for_tokens(self, tokens: int, every: bool = False) -> Iterator[None]:
        """Run one micro-batch's forward and backward with checkpointing as its size needs (``auto``);
        ``every``: with every layer checkpointed (a retry after :meth:`retry_after_oom`)."""
        if not self.auto:
            yield
            return
        count = len(self.layers) if every else self.layers_needed(tokens)
        self.decisions.append(count / len(self.layers))
        self._set(count)
        try:
            if count:
                yield
            else:
                with peak.window(self.device) as measured:
                    yield
                if measured.above_base is not None:
                    self.observe(tokens, measured.above_base)
        finally:
            self._set(0)

    def take_metrics(self) -> dict[str, float]:
        """``<role>/recompute_frac``: share of the layer forwards of the micro-batches since the last call
        that were checkpointed (a micro-batch recomputing half its layers counts a half)."""
        if not self.decisions:
            return {}
        out = {f"{self.role}/recompute_frac": sum(self.decisions) / len(self.decisions),
               f"{self.role}/activation_mb_per_token": self.bytes_per_token / 1e6}
        if self.oom_retries:
            out[f"{self.role}/recompute_oom_retries"] = float(self.oom_retries)
        self.decisions, self.oom_retries = [], 0
        return out

    def _accumulated(self, param: torch.Tensor) -> None:
        self.accumulations += 1

    def retry_after_oom(self, accumulations: int, tokens: int = 0) -> bool:
        """After an out-of-memory error in a micro-batch's forward or backward under ``auto``: whether it
        may run again with every layer checkpointed: it checkpointed fewer, no gradient reached a trained
        parameter since :attr:`accumulations` was ``accumulations`` (so nothing of it was added to
        ``.grad``; the parameters are plain, not sharded: :attr:`retriable`), and the process trains
        alone (another would wait in its collectives). If so, partial
        plans stop for the rest of the run, the allocator's unused blocks go back to the device, and
        ``<role>/recompute_oom_retries`` counts it; micro-batches of ``tokens`` tokens or more checkpoint
        every layer from then on."""
        import torch.distributed as dist

        if (not self.auto or not self.retriable or not self.decisions or self.decisions[-1] >= 1.0
                or self.accumulations != accumulations):
            return False
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return False
        share = self.decisions.pop()  # the micro-batch is counted once, as it runs again
        self.partial = False
        self.oom_retries += 1
        if tokens > 0:
            self.oom_tokens = min(self.oom_tokens or tokens, tokens)
        log.warning("%s.gradient_checkpointing=auto: a micro-batch of %d tokens checkpointing %s ran out of memory "
                    "before any gradient was accumulated; it runs again with every layer checkpointed, and so do "
                    "the micro-batches of as many tokens or more, and every one that does not fit, from now on",
                    self.role, tokens, "no layer" if share == 0 else "some of its layers")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True
