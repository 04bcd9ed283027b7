"""The fast rollout engine: paged KV cache, compiled CUDA-graph decode and continuous batching.

:class:`RolloutEngine` runs Llama-family decoders (Llama, Mistral, Qwen2) with its own forward
(:mod:`rlcore.rollout.engine.llama`, :mod:`rlcore.rollout.engine.decode`) over the Hugging Face module's weights:

* the KV cache is a pool of pages allocated once (``kv_cache="paged"``, the default,
  :mod:`rlcore.rollout.engine.pages`), sized from the device's free memory; a slot takes pages as
  its sequence grows and gives them back when it ends, admission waits for free pages, and a
  slot that finds none is preempted (freed and queued again); or one static tensor for
  ``max_batch_size`` slots of ``max_seq_len`` tokens (``kv_cache="static"``);
* prompts are prefilled in groups, left padded, positions taken from the attention mask; a prompt
  repeated in a group (``n`` samples per prompt) is prefilled once; with pages its samples point
  at the same prompt pages (reference counted, only the page the samples go on writing in is
  copied); with the static cache its keys/values are copied and, with the Triton attention kernel,
  its samples read them from one cache row (``prompt_sharing``);
* each decode step runs every slot at its own cache column and attends over the filled columns
  only (rounded up to a length bucket); on CUDA the pointwise work between the matrix products
  is fused by ``torch.compile`` and the step is captured in a CUDA graph per (batch bucket,
  length bucket) and replayed;
* sampling (:mod:`rlcore.rollout.sampling`) runs on the device with a seeded generator;
* continuous batching (:mod:`rlcore.rollout.engine.scheduler`): a finished sequence frees its slot and
  the next waiting prompt is prefilled into it; once the queue is empty, live slots are compacted
  so a smaller graph bucket can run.

Works on CPU too (no graphs, no compilation by default), which is what the CPU tests and the
CPU training demo use.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from rlcore.rollout.engine import decode
from rlcore.rollout.engine import extend
from rlcore.rollout.engine import llama
from rlcore.rollout.adapters import has_adapter_layers, unwrap
from rlcore.rollout.engine import pages
from rlcore.rollout.engine import vmem
from rlcore.rollout.engine.graphs import DecodeGraphs
from rlcore.rollout.engine.settings import (DEFAULT_BUCKETS, FEW_ROWS, check_limits,  # noqa: F401
                                            check_page_size, check_settings, choose_attention, choose_products,
                                            length_step)
from rlcore.rollout.base import RolloutBatch, SamplingParams, host_to_device, left_pad
from rlcore.rollout.sampling import validate_params

log = logging.getLogger(__name__)


def _distinct(slots: Sequence[int], prompts: Sequence[Sequence[int]]):
    """``(unique, owner, source)``: the distinct prompts in order of first occurrence, the slot of
    each one's first occurrence, and for every slot the index of its prompt in ``unique``."""
    index: dict[tuple[int, ...], int] = {}
    unique: list[Sequence[int]] = []
    owner: list[int] = []
    source: list[int] = []
    for slot, prompt in zip(slots, prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(unique)
            unique.append(prompt)
            owner.append(slot)
        source.append(index[key])
    return unique, owner, source


def _model_device(model) -> torch.device:
    param = next(model.parameters())
    return param.device


class RolloutEngine:
    """Generate with a paged KV cache, compiled CUDA-graph decode steps and continuous batching.

    Args:
        model: a HF ``LlamaForCausalLM``/``MistralForCausalLM``/``Qwen2ForCausalLM`` (see :meth:`supports`).
        max_batch_size: number of cache slots (sequences decoded at once); more prompts queue up.
        max_seq_len: cache length per slot; every prompt's padded width plus ``max_new_tokens``
            must fit in it.
        dtype: compute dtype (default: the model's).
        device: where to run (default: the model's device).
        use_cuda_graphs: capture the decode step in CUDA graphs (ignored off CUDA).
        graph_batch_buckets: batch sizes to capture; ``max_batch_size`` is always added.
        share_weights: reference the model's tensors instead of owning (fused) copies. Default:
            share when dtype and device match and graphs are off (the CPU path), else copy.
        admit_fraction: refill free slots once at least this fraction of the batch is free
            (or when nothing is running), so prefill runs in groups, not one prompt a step.
        eos_check_interval: decode steps between host reads of the finished flags.
        lagged_turn_ends: multi-turn calls read the turn-end flags and the rows' tokens without waiting
            for the device: a copy to pinned memory and an event every ``eos_check_interval`` steps,
            read once the device has passed it (turns end a few steps later; the tokens decoded past
            a turn's end are dropped, as between checks; on by default). Off: each check waits for the device.
        max_prefill_tokens: bound on ``prompts x width`` per prefill call (activation memory).
        fused_sampling: on CUDA, sample unfiltered (no top-k/top-p) steps with the one-pass
            Triton kernel (:mod:`rlcore.kernels.fused_sampling`), checked once against PyTorch.
        compile: fuse the decode step's pointwise work with ``torch.compile`` (default: on CUDA
            only). If compilation fails the engine logs a warning and runs the plain step.
        compile_mode: ``torch.compile`` mode, ``"default"`` or ``"max-autotune-no-cudagraphs"``
            (the engine does its own graph capture, so modes that add CUDA graphs are refused).
        attention: ``"auto"`` (default: ``"triton"`` where it can run, else ``"sdpa"``), ``"sdpa"``
            (PyTorch's fused attention) or ``"triton"`` (the
            grouped-query decode kernel of :mod:`rlcore.kernels.decode_attention`, checked once against
            PyTorch; without Triton or CUDA, or if the check fails, the engine logs a warning and uses
            ``"sdpa"``).
        attention_length_step: granularity of the attended cache length (default: :func:`length_step`).
        rope_in_attention: with ``attention="triton"``, let the attention kernel also apply RoPE and
            write the new key/value to the cache (one kernel per layer instead of three). Ignored
            for the other attention kinds.
        split_k: cut the decode step's o, gate/up, down or q/k/v products into this many slices of
            their inner dimension, e.g. ``{"down": 4}``: one batched product with more output tiles, the
            partial sums added by the kernel that reads them (see :func:`rlcore.rollout.engine.decode._partials`;
            the q/k/v slices by the attention kernel when it applies RoPE).
            ``"auto"`` (default): :data:`rlcore.rollout.engine.decode.AUTO_SPLIT_K` when the step is compiled
            on CUDA (the compiler fuses the sums), else none; ``None`` or ``{}``: none.
        split_k_few_rows: the same for batch buckets of at most :data:`FEW_ROWS` rows (a long rollout's
            tail, where a product reads its weights for a handful of rows); ``None`` (default): as ``split_k``.
        mlp_transposed: take the decode step's gate/up product as ``weight @ norm(x)^T`` (the
            library's tiles fit that tall output better at a few hundred rows; SiLU·mul and the down
            product read the transposed layout). ``"auto"`` (default): on when the step is compiled on
            CUDA.
        attention_tuning: settings of the Triton attention kernel, e.g. ``{"num_warps": 2}``; keys in
            :data:`rlcore.rollout.engine.decode.ATTENTION_TUNING_KEYS` (see
            :func:`rlcore.rollout.engine.decode.check_attention_tuning`).
        prompt_sharing: with ``attention="triton"``, the samples of a prompt prefilled together read
            the prompt's columns from the cache row of its first sample instead of their own copies
            (same results, fewer bytes from memory). A slot whose source row is refilled or moved
            goes back to its own copy. Used in the ``generate`` calls where some prompt repeats
            (the kernel then loads two more numbers a slot); ignored for the other attention kinds.
            With ``kv_cache="paged"`` (any attention kind) the samples point at the same prompt pages
            instead; ``False`` gives each sample copies of them.
        kv_cache: ``"paged"`` (default): a pool of pages of ``page_size`` columns, taken by the
            tokens actually live (see :mod:`rlcore.rollout.engine.pages`); ``"static"``: one
            ``[layers, 2, max_batch_size, kv_heads, max_seq_len, head_dim]`` tensor.
        page_size: columns per page (a power of two >= 16, a multiple of the Triton kernel's block).
        kv_pages: pages in the pool (the null page included); default: every slot at ``max_seq_len``,
            capped on CUDA by ``kv_memory_fraction``.
        kv_memory_fraction: share of the device's free memory (when the engine is built), less
            ``kv_reserve_bytes``, the page pool may take (default 0.5).
        kv_reserve_bytes: memory that work after the rollout will still allocate (the trainer passes
            the gradients and optimizer moments of the trainable weights not yet allocated), kept out
            of the free memory before ``kv_memory_fraction`` applies (default 0).
        release_kv: let :meth:`release_kv` hand the KV cache's memory back to the device between
            rollouts, to be taken again at the same addresses (the CUDA graphs stay valid) when the
            engine next runs (:mod:`rlcore.rollout.engine.vmem`); ``None`` (default): where the device allows
            it (CUDA), ``True``: required (``ValueError`` where it cannot be done), ``False``: never.
    """

    #: one ``generate`` call takes any number of prompts and queues those beyond its slots, admitting
    #: them as slots free up (a caller need not cut a large rollout into calls of ``max_batch_size``)
    continuous_batching = True

    @property
    def supports_episodes(self) -> bool:
        """Prompts carrying an episode are played as multi-turn episodes (paged or static KV cache)."""
        return True

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, use_cuda_graphs: bool = True,
                 graph_batch_buckets: Sequence[int] = DEFAULT_BUCKETS, share_weights: bool | None = None,
                 admit_fraction: float = 0.125, eos_check_interval: int = 8, max_prefill_tokens: int = 65536,
                 fused_sampling: bool = True, compile: bool | None = None, compile_mode: str = "default",
                 attention: str = "auto", attention_length_step: int | None = None,
                 rope_in_attention: bool = True, split_k: Mapping[str, int] | str | None = "auto",
                 split_k_few_rows: Mapping[str, int] | None = None,
                 attention_tuning: Mapping[str, object] | None = None, prompt_sharing: bool = True,
                 mlp_transposed: bool | str = "auto", kv_cache: str = "paged", page_size: int = pages.PAGE_SIZE,
                 kv_pages: int | None = None, kv_memory_fraction: float = pages.KV_MEMORY_FRACTION,
                 kv_reserve_bytes: int = 0, lagged_turn_ends: bool = True, release_kv: bool | None = None):
        check_settings(max_batch_size, max_seq_len, attention, compile_mode, mlp_transposed, kv_cache, page_size,
                        kv_pages, kv_memory_fraction)
        model = unwrap(model)  # a LoRA (peft) model: its decoder, read with the adapters merged
        self.paged = kv_cache == "paged"
        self.page_size = int(page_size)
        self.spec = llama.decoder_spec(model)
        if self.spec.sliding_window is not None and self.spec.sliding_window < max_seq_len:
            raise ValueError(f"RolloutEngine: sliding_window {self.spec.sliding_window} < max_seq_len "
                             f"{max_seq_len}; use the HF backend or a shorter max_seq_len")
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.dtype = dtype or next(model.parameters()).dtype
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.use_cuda_graphs = bool(use_cuda_graphs) and self.device.type == "cuda"
        adapters = has_adapter_layers(model)
        if share_weights and adapters:
            raise ValueError("RolloutEngine: share_weights=True cannot merge LoRA adapters; the engine must own "
                             "its weights (leave share_weights unset)")
        if share_weights is None:  # merged LoRA weights need owned copies, refreshed by sync_weights
            share_weights = (not self.use_cuda_graphs and self.dtype == next(model.parameters()).dtype
                             and _model_device(model) == self.device and not adapters)
        self.weights = llama.DecoderWeights.from_model(model, self.dtype, self.device, share=share_weights)
        self.buckets = sorted({b for b in graph_batch_buckets if 0 < b < max_batch_size} | {max_batch_size})
        step = int(attention_length_step or length_step(self.max_seq_len))
        self.length_buckets = sorted({min(k * step, self.max_seq_len)
                                      for k in range(1, -(-self.max_seq_len // step) + 1)})
        self.admit_fraction = float(admit_fraction)
        self.eos_check_interval = max(1, int(eos_check_interval))
        self.lagged_turn_ends = bool(lagged_turn_ends)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.fused_sampling = bool(fused_sampling)
        self.attention_tuning = decode.check_attention_tuning(attention_tuning)
        self.attention = choose_attention(attention, self.device, self.dtype, self.spec, self.attention_tuning,
                                          self.page_size if self.paged else None)
        self.compile = self.device.type == "cuda" if compile is None else bool(compile)
        self.rope_in_attention = self.attention == "triton" and bool(rope_in_attention)
        # paged: the samples of a prompt share its pages; static: they read one row (Triton kernel)
        self.share_pages = self.paged and bool(prompt_sharing)
        self.prompt_sharing = not self.paged and self.attention == "triton" and bool(prompt_sharing)
        self.split_k, self.mlp_transposed = choose_products(split_k, mlp_transposed, self.compile, self.device)
        self._plain, self._fns = self._step_functions(self.split_k, compile_mode)
        #: buckets of at most FEW_ROWS rows: their own step functions where split_k_few_rows differs
        self.split_k_few_rows = self.split_k if split_k_few_rows is None else decode.split_k_tuple(split_k_few_rows)
        self._plain_few = self._fns_few = None
        if self.split_k_few_rows != self.split_k:
            if any(k > 1 for k in self.split_k_few_rows):
                decode.probe_float32_partials(self.device)
            self._plain_few, self._fns_few = self._step_functions(self.split_k_few_rows, compile_mode)
        #: memory kept out of the free memory before the page pool is sized
        self.kv_reserve_bytes = int(kv_reserve_bytes)
        self._allocate(kv_pages, float(kv_memory_fraction), self.kv_reserve_bytes, release_kv)
        if self.compile:
            self._mark_static()
        self._graphs = DecodeGraphs(self) if self.use_cuda_graphs else None
        self._extend_graphs = (extend.ExtendGraphs(self) if self.use_cuda_graphs and self.paged
                               and self.attention == "triton" and extend.ENABLED else None)
        #: running totals the schedulers report per call: decode steps replayed from a CUDA graph or run
        #: eagerly, prefill and extend forwards and the tokens they ran, decode graphs captured (on first
        #: use of a batch and length bucket) and the seconds that took
        self.counters = dict.fromkeys(("graph_steps", "eager_steps", "prefill_calls", "prefill_tokens",
                                       "extend_calls", "extend_tokens", "graph_captures", "graph_capture_s",
                                       "extend_graph_calls", "extend_graph_captures"), 0)
        log.info("rollout engine: %d layers, %d slots x %d tokens, %s KV cache%s, %s on %s, cuda graphs %s, "
                 "compile %s, attention %s%s", self.spec.num_layers, max_batch_size, max_seq_len, kv_cache,
                 f" ({self.pool.pages} pages of {self.page_size}, {self.kv_bytes / 2**30:.2f} GiB)" if self.paged
                 else "", self.dtype, self.device,
                 "on" if self.use_cuda_graphs else "off", compile_mode if self.compile else "off", self.attention,
                 " (with RoPE and cache write)" if self.rope_in_attention else "")

    # ------------------------------------------------------------------ public API

    @staticmethod
    def supports(model, max_seq_len: int | None = None) -> bool:
        """True for Llama/Mistral/Qwen2-style decoders the engine can run."""
        return llama.supports(model, max_seq_len)

    def sync_weights(self) -> None:
        """Copy the training model's current weights in place (captured graphs stay valid)."""
        if not self.weights.share:
            self.weights.copy_from(self.model)
            return
        before = self.weights.pointers()
        self.weights = llama.DecoderWeights.from_model(self.model, self.dtype, self.device, share=True)
        if self.compile:
            self._mark_static()
        if self._graphs is not None and self.weights.pointers() != before:
            self._graphs.clear()  # storage moved: recapture lazily
            if self._extend_graphs is not None:
                self._extend_graphs.clear()

    def release_kv(self) -> int:
        """Hand the KV cache's memory back to the device until the engine next runs (the trainer calls
        this after a rollout, so the update has that memory); the bytes freed, 0 where the cache cannot
        be released (``release_kv=False``, not CUDA) or already is. Its contents are not kept."""
        return self._kv.release()

    @property
    def kv_released(self) -> bool:
        """Whether the KV cache's memory is handed back now (taken again by the next ``generate``)."""
        return not self._kv.mapped

    def _take_kv(self) -> float:
        """Map the KV cache's memory again where it was released (zeroed, at the same addresses); the
        seconds that took (0 when it was mapped)."""
        if self._kv.mapped:
            return 0.0
        start = time.perf_counter()
        self._kv.acquire()
        return time.perf_counter() - start

    def warmup(self, batch_sizes: Sequence[int] | None = None) -> None:
        """Capture the decode graphs of ``batch_sizes`` (default: every bucket), at every attention
        length, now instead of on first use. Without CUDA graphs this compiles (if on) and returns."""
        sizes = sorted({self._bucket(b) for b in (batch_sizes or self.buckets)})
        self._take_kv()
        if self._graphs is None:
            for n in sizes:
                self._warm_eager(n)
            return
        for n in sizes:
            for length in self.length_buckets:
                for sharing in (False, True) if self.prompt_sharing else (False,):
                    self.state.share_active = sharing
                    if (n, length, sharing) not in self._graphs.graphs:
                        self._graphs.run(n, length)
                    if self._graphs is None:  # capture failed: eager from now on
                        self.state.share_active = False
                        return
        self.state.share_active = False

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finished: Optional[Callable[[list[int], list[list[int]]], None]] = None,
                 max_new_tokens: Optional[Sequence[int]] = None) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~rlcore.rollout.base.RolloutBackend`.

        ``on_finished(indices, responses)``, if given, is called from the decode loop as requests
        finish, with their prompt indices and response tokens (up to and including the first EOS,
        as in the result); it should return quickly (hand the work to another thread).

        Prompts that carry an episode (:class:`rlcore.envs.runner.EpisodePrompt`) are played as
        multi-turn episodes (:mod:`rlcore.rollout.engine.turns`, either KV cache):
        ``max_new_tokens`` then bounds each response with its observations; ``on_finished`` is not
        called for them.

        ``max_new_tokens`` (single-turn prompts only): each prompt's own token limit, from 1 to
        ``params.max_new_tokens``; a response stops at its limit or its EOS.

        ``params.stop_at_rows`` (single-turn prompts only; episodes always play to their end): the call
        ends once at most that many samples are still decoding and no prompt waits for a slot; those
        come back with the tokens they have, marked in the result's ``cut``."""
        from rlcore.envs.runner import episodes_of
        from rlcore.rollout.engine.scheduler import Scheduler
        from rlcore.rollout.engine.turns import TurnScheduler

        validate_params(params, self.spec.vocab_size)
        if len(prompts) == 0:
            raise ValueError("RolloutEngine.generate: no prompts given")
        widest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("RolloutEngine.generate: empty prompt")
        if max_new_tokens is not None and len(max_new_tokens) == len(prompts):  # each prompt with its own limit
            longest = max(len(p) + min(int(n), params.max_new_tokens) for p, n in zip(prompts, max_new_tokens))
        else:
            longest = widest + params.max_new_tokens
        if longest > self.max_seq_len:
            raise ValueError(f"RolloutEngine.generate: a prompt with its new tokens takes {longest} columns "
                             f"(longest prompt {widest}, max_new_tokens {params.max_new_tokens}), more than "
                             f"max_seq_len {self.max_seq_len}")
        start = time.perf_counter()
        taken_s = self._take_kv()
        # the sharing kernel only when some prompt repeats (it loads two more numbers a slot)
        self.state.share_active = self.prompt_sharing and len({tuple(p) for p in prompts}) < len(prompts)
        episodes, runner = episodes_of(prompts)
        if max_new_tokens is not None:
            check_limits(max_new_tokens, len(prompts), params.max_new_tokens, episodes=runner is not None)
        if runner is None:
            run = Scheduler(self, prompts, params, on_finished, limits=max_new_tokens)
        else:
            run = TurnScheduler(self, prompts, params, episodes, *runner.stops(), runner.decode)
        run.loop()
        batch = run.result()
        batch.stats["rollout/seconds"] = time.perf_counter() - start
        if self._kv.releasable:  # the KV cache taken again after its release (0 s when it was not released)
            batch.stats["rollout/kv_acquire_s"] = taken_s
        return batch

    # ------------------------------------------------------------------ internals

    def _allocate(self, kv_pages: int | None, fraction: float, reserve: int = 0,
                  release: bool | None = False) -> None:
        spec, b, s = self.spec, self.max_batch_size, self.max_seq_len
        dev = self.device
        if self.paged:
            size = self.page_size
            per_page = pages.page_bytes(spec.num_layers, spec.num_kv_heads, size, spec.head_dim, self.dtype)
            count = pages.pool_pages(slots=b, max_seq_len=s, page_size=size, bytes_per_page=per_page, device=dev,
                                     kv_pages=kv_pages, fraction=fraction, reserve_bytes=reserve)
            self.pool = pages.PagePool(count)
            self._kv = vmem.zeros((spec.num_layers, 2, count, spec.num_kv_heads, size, spec.head_dim), self.dtype,
                                  dev, release)
            self.kv_bytes = count * per_page
            #: pages of each slot, in column order (0: the null page); mirrored by ``state.table``
            self.slot_pages: list[list[int]] = [[] for _ in range(b)]
            table = torch.zeros(b, -(-s // size), dtype=torch.int32, device=dev)
        else:
            self._kv = vmem.zeros((spec.num_layers, 2, b, spec.num_kv_heads, s, spec.head_dim), self.dtype, dev,
                                  release)
            self.kv_bytes = self._kv.nbytes
            table = None
        self.cache = self._kv.tensor
        self.state = decode.DecodeState.empty(spec, b, s, self.dtype, dev, table, self.page_size if self.paged else 0,
                                              self.prompt_sharing)
        cos, sin = llama.rope_table(self.model, s, dev)
        self.cos, self.sin = cos, llama.signed_sin(sin)  # float32, for prefill
        self.step_cos, self.step_sin = self.cos.to(self.dtype), self.sin.to(self.dtype)

    def _step_functions(self, split: tuple[int, ...], compile_mode: str) -> tuple:
        """``(plain, used)`` step functions of products cut by ``split``: ``used`` compiled when the
        engine compiles, else the plain ones."""
        plain = decode.step_functions(self.spec, rope_in_attention=self.rope_in_attention, split_k=split,
                                      mlp_transposed=self.mlp_transposed)
        if not self.compile:
            return plain, plain
        return plain, decode.step_functions(self.spec, compile_mode, self.rope_in_attention, split, self.mlp_transposed)

    def _mark_static(self) -> None:
        try:
            decode.mark_static([*self.weights.tensors(), self.step_cos, self.step_sin])
        except Exception as error:  # noqa: BLE001 - a hint to the compiler, never fatal
            log.debug("rollout engine: mark_static unavailable (%s)", error)

    def _decode_eager(self, n: int, length: int) -> torch.Tensor:
        """One decode step without graphs; falls back to the plain pieces if compilation fails."""
        few = self._fns_few is not None and n <= FEW_ROWS
        fns, plain = (self._fns_few, self._plain_few) if few else (self._fns, self._plain)
        if fns.compiled:
            try:
                return self._step(n, length, fns)
            except Exception as error:  # noqa: BLE001 - compiler failures take many forms
                log.warning("rollout engine: compiled decode step failed (%s: %s); running it uncompiled",
                            type(error).__name__, str(error)[:500])
                self._fns, self._fns_few, self.compile = self._plain, self._plain_few, False
        return self._step(n, length, plain)

    def _step(self, n: int, length: int, fns: decode.StepFunctions) -> torch.Tensor:
        cos, sin = (self.cos, self.sin) if fns.rope_in_attention else (self.step_cos, self.step_sin)
        return decode.decode(self.weights, self.cache, self.state, n, length, cos, sin, fns, self.attention,
                             self.attention_tuning)

    def _warm_eager(self, n: int) -> None:
        """Run (and so compile) a step of ``n`` slots, leaving the decode state as it was."""
        st = self.state
        saved = (st.positions[:n].clone(), st.cache_index[:n].clone(), st.bias[:n].clone())
        self._decode_eager(n, self.length_buckets[-1])
        st.positions[:n].copy_(saved[0])
        st.cache_index[:n].copy_(saved[1])
        st.bias[:n].copy_(saved[2])

    def _decode(self, n: int, length: int) -> torch.Tensor:
        if self._graphs is not None:
            logits = self._graphs.run(n, length)
            self.counters["graph_steps" if self._graphs is not None else "eager_steps"] += 1
            return logits
        self.counters["eager_steps"] += 1
        return self._decode_eager(n, length)

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.max_batch_size

    def _length_bucket(self, needed: int) -> int:
        for length in self.length_buckets:
            if length >= needed:
                return length
        return self.max_seq_len

    def _prefill(self, slots: list[int], prompts: list[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, int]:
        """Prefill ``prompts`` into ``slots`` and reset those slots' decode state.

        A prompt that occurs several times (GRPO's ``n`` samples of one prompt) is run once, in the
        slot of its first occurrence, and its next-token logits shared (each slot still samples on
        its own). With pages the other slots point at its pages (:meth:`_prefill_pages`); with the
        static cache its keys/values are copied to their rows.

        Returns ``(logits [len(slots), V], width)``: the next-token logits and the padded width
        (the cache column of each slot's first decode step)."""
        unique, owner, source = _distinct(slots, prompts)
        ids, mask = left_pad(unique, pad_id, self.device)
        width = ids.shape[1]
        padded = any(len(p) != width for p in unique)
        chunk = max(1, self.max_prefill_tokens // width)
        self.counters["prefill_calls"] += 1
        self.counters["prefill_tokens"] += len(unique) * width
        if self.paged:
            logits = self._prefill_pages(slots, unique, owner, source, ids, mask, chunk, padded)
        else:
            owner_rows = torch.tensor(owner, dtype=torch.long, device=self.device)
            logits = torch.cat([llama.prefill(self.weights, self.spec, self.cache, owner_rows[i:i + chunk],
                                              ids[i:i + chunk], mask[i:i + chunk], self.cos, self.sin, padded=padded)
                                for i in range(0, len(unique), chunk)])
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        if len(unique) < len(slots) and not self.paged:
            copies = [i for i, slot in enumerate(slots) if slot != owner[source[i]]]
            src = torch.tensor([owner[source[i]] for i in copies], dtype=torch.long, device=self.device)
            self.cache[:, :, rows[copies], :, :width] = self.cache[:, :, src, :, :width]
        if len(unique) < len(slots):
            pick = torch.tensor(source, dtype=torch.long, device=self.device)
            logits, mask = logits[pick], mask[pick]
        st = self.state
        if self.prompt_sharing:
            # slots reading from a row refilled now go back to their own copy; the new slots read
            # the prompt's columns from its first sample's row
            st.share_end.masked_fill_(torch.isin(st.share_source, rows.to(torch.int32)), 0)
            first = torch.tensor([owner[i] for i in source], dtype=torch.int32, device=self.device)
            st.share_source[rows] = first
            st.share_end[rows] = torch.where(first == rows.to(torch.int32), 0, width).to(torch.int32)
        bias = torch.full((len(slots), self.max_seq_len), float("-inf"), dtype=self.dtype, device=self.device)
        bias[:, :width].masked_fill_(mask.bool(), 0.0)
        st.bias[rows] = bias
        st.positions[rows] = mask.sum(-1)
        st.cache_index[rows] = width
        return logits, width

    def _prefill_pages(self, slots: list[int], unique: list[Sequence[int]], owner: list[int], source: list[int],
                       ids: torch.Tensor, mask: torch.Tensor, chunk: int, padded: bool) -> torch.Tensor:
        """Prefill the distinct prompts ``unique`` (left padded to ``ids``' width) and give every slot of
        ``slots`` its pages; returns the distinct prompts' next-token logits.

        Each distinct prompt gets fresh pages for its columns, the pages wholly in its left padding
        excepted (the null page stands for them); its keys/values are computed in a scratch cache of
        the chunk and moved into those pages. The other slots of the prompt point at the same pages
        (``share_pages``), except the last page when the prompt ends inside it: decoding goes on
        writing there, so each slot gets its own copy of that one. Without ``share_pages`` every slot
        gets copies of all."""
        spec, size, pool = self.spec, self.page_size, self.pool
        width = ids.shape[1]
        count, full = -(-width // size), width // size
        firsts = [(width - len(prompt)) // size for prompt in unique]
        wanted = sum(count - first for first in firsts)
        wanted += sum(count - (full if self.share_pages else firsts[src])
                      for slot, src in zip(slots, source) if slot != owner[src])
        if wanted > pool.free:
            raise MemoryError(f"rollout engine: prefill needs {wanted} KV pages, {pool.free} free")
        owned = [[0] * first + pool.take(count - first) for first in firsts]
        logits = []
        for start in range(0, len(unique), chunk):
            rows = min(chunk, len(unique) - start)
            scratch = torch.zeros(spec.num_layers, 2, rows, spec.num_kv_heads, count * size, spec.head_dim,
                                  dtype=self.dtype, device=self.device)
            logits.append(llama.prefill(self.weights, spec, scratch, torch.arange(rows, device=self.device),
                                        ids[start:start + rows], mask[start:start + rows], self.cos, self.sin,
                                        padded=padded))
            pairs = [(r, j, owned[start + r][j]) for r in range(rows) for j in range(firsts[start + r], count)]
            at_row, at_page, dest = (torch.tensor(column, dtype=torch.long, device=self.device)
                                     for column in zip(*pairs))
            blocks = scratch.view(spec.num_layers, 2, rows, spec.num_kv_heads, count, size, spec.head_dim)
            self.cache[:, :, dest] = blocks[:, :, at_row, :, at_page].permute(1, 2, 0, 3, 4, 5)
            del scratch, blocks
        copy_from, copy_to = [], []
        table = torch.zeros(len(slots), self.state.table.shape[1], dtype=torch.int32)
        for index, (slot, src) in enumerate(zip(slots, source)):
            if self.slot_pages[slot]:
                pool.drop(self.slot_pages[slot])
            mine = owned[src]
            if slot != owner[src]:
                keep = full if self.share_pages else firsts[src]
                fresh = pool.take(count - keep)
                for page in mine[:keep]:
                    pool.share(page)
                copy_from += mine[keep:]
                copy_to += fresh
                mine = mine[:keep] + fresh
            self.slot_pages[slot] = list(mine)
            table[index, :count] = torch.tensor(mine, dtype=torch.int32)
        if copy_to:
            self.cache[:, :, torch.tensor(copy_to, device=self.device)] = \
                self.cache[:, :, torch.tensor(copy_from, device=self.device)]
        self.state.table[torch.tensor(slots, dtype=torch.long, device=self.device)] = table.to(self.device)
        return torch.cat(logits)

    def _add_pages(self, slots: list[int]) -> None:
        """One more page at the end of each of ``slots``' columns (the caller made sure enough are free)."""
        fresh = self.pool.take(len(slots))
        at = []
        for slot, page in zip(slots, fresh):
            at.append(len(self.slot_pages[slot]))
            self.slot_pages[slot].append(page)
        where = self._to_device(torch.tensor([list(slots), at], dtype=torch.long))
        self.state.table[where[0], where[1]] = self._to_device(torch.tensor(fresh, dtype=torch.int32))

    def _extend(self, rows: Sequence[int], appends: Sequence[Sequence[int]], columns: Sequence[int],
                positions: Sequence[int], lows: Sequence[int]) -> torch.Tensor:
        """Append ``appends[i]`` to the sequence of cache row ``rows[i]`` at cache column ``columns[i]``
        and position ``positions[i]``, every row in one forward (:func:`rlcore.rollout.engine.llama.extend`:
        a prefill of the new tokens only, the rows' caches kept), and make the rows continue after
        them. A row's valid columns are then ``lows[i]`` (its first column after the prompt's left
        padding) up to its new tokens; columns it had written from ``columns[i]`` on (tokens decoded
        past a turn's end) are dropped. With pages the rows' pages must already cover the new columns
        (:meth:`_set_pages`). Returns the ``[m, V]`` logits of the token after each append."""
        lengths = [len(ids) for ids in appends]
        ends = [c + k for c, k in zip(columns, lengths)]
        for row, end, k in zip(rows, ends, lengths):
            if k < 1 or end >= self.max_seq_len:
                raise ValueError(f"RolloutEngine: appending {k} tokens to row {row} up to column {end} does not fit "
                                 f"max_seq_len {self.max_seq_len} (or appends nothing)")
        numbers = torch.tensor([list(rows), list(columns), list(positions), list(lows), ends,
                                [p + k for p, k in zip(positions, lengths)]], dtype=torch.long)
        row, column, position, low, end, after = self._to_device(numbers).unbind(0)
        st = self.state
        span = torch.arange(self.max_seq_len, device=self.device)
        st.bias[row] = torch.where((span >= low[:, None]) & (span < end[:, None]), 0.0, float("-inf")).to(self.dtype)
        hidden = None
        if self._extend_graphs is not None:
            hidden = self._extend_graphs.run(appends, rows, columns, positions, max(ends))
        if hidden is not None:
            logits = F.linear(hidden, self.weights.lm_head)
            self.counters["extend_graph_calls"] += 1
        else:
            ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
            for i, tokens in enumerate(appends):
                ids[i, :lengths[i]] = torch.as_tensor(list(tokens), dtype=torch.long)
            logits = llama.extend(self.weights, self.spec, self.cache, row, self._to_device(ids), lengths, column,
                                  position, st.bias, self.cos, self.sin, max(ends), st.table, self.attention,
                                  self.attention_tuning)
        st.positions[row] = after
        st.cache_index[row] = end
        self.counters["extend_calls"] += 1
        self.counters["extend_tokens"] += sum(lengths)
        return logits

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device without waiting for the device (:func:`host_to_device`)."""
        return host_to_device(host, self.device)

    def _set_pages(self, rows: Sequence[int], page_lists: Sequence[list[int]]) -> None:
        """Give cache rows ``rows`` the pages ``page_lists`` (in column order), table rows included."""
        table = torch.zeros(len(rows), self.state.table.shape[1], dtype=torch.int32)
        for i, (row, owned) in enumerate(zip(rows, page_lists)):
            self.slot_pages[row] = list(owned)
            table[i, :len(owned)] = torch.tensor(owned, dtype=torch.int32)
        index = self._to_device(torch.tensor(list(rows), dtype=torch.long))
        self.state.table[index] = self._to_device(table)

    def _release(self, slots: list[int], keep_pages: bool = False) -> list[list[int]]:
        """Freed slots keep decoding (their output is ignored) until reused: give each a valid
        key in column 0 so that attention over a short length never sees an all-masked row.
        With pages, the slots' pages go back to the pool (or, ``keep_pages``, are returned to the
        caller, still held: a paused multi-turn episode leaving its row) and their table rows to
        the null page (which their idle steps then write to and read from), their next column back
        to 1, so that an idle row's attention reads a few columns of the null page, not as many as its
        last sequence had. ``slots``: host indices (no device read). Returns the page lists taken off
        the slots."""
        rows = self._to_device(torch.tensor(slots, dtype=torch.long))
        self.state.bias[rows, 0] = 0.0
        taken = []
        if self.paged:
            for slot in slots:
                taken.append(self.slot_pages[slot])
                if not keep_pages:
                    self.pool.drop(self.slot_pages[slot])
                self.slot_pages[slot] = []
            self.state.table[rows] = 0
            self.state.cache_index[rows] = 1
            self.state.positions[rows] = 1
        return taken

    def _compact(self, live: list[int]) -> None:
        """Move live slots ``live`` (sorted) to rows ``0..len(live)-1``."""
        m = len(live)
        perm = self._to_device(torch.tensor(live, dtype=torch.long))
        st = self.state
        if self.paged:  # the pages stay where they are: only the table rows move
            st.table[:m] = st.table.index_select(0, perm)
            st.table[m:] = 0
            self.slot_pages = [self.slot_pages[s] for s in live] + [[] for _ in range(self.max_batch_size - m)]
        else:
            self.cache[:, :, :m] = self.cache.index_select(2, perm)
        for buf in (st.tokens, st.positions, st.cache_index, st.bias):
            buf[:m] = buf.index_select(0, perm)
        st.bias[m:, 0] = 0.0  # rows past the live ones are free (see _release)
        if self.paged:
            st.cache_index[m:] = 1
            st.positions[m:] = 1
        if self.prompt_sharing:
            # a source row that moved is followed to its new row; one that is no longer live
            # sends the slot back to its own (moved) copy
            moved_to = torch.full((self.max_batch_size,), -1, dtype=torch.int32, device=self.device)
            moved_to[perm] = torch.arange(m, dtype=torch.int32, device=self.device)
            source = moved_to[st.share_source.index_select(0, perm).long()]
            own = torch.arange(self.max_batch_size, dtype=torch.int32, device=self.device)
            st.share_end[:m] = torch.where(source >= 0, st.share_end.index_select(0, perm), 0)
            st.share_source[:m] = torch.where(source >= 0, source, own[:m])
            st.share_source[m:] = own[m:]
            st.share_end[m:] = 0
