"""The fast rollout engine: static KV cache, CUDA-graph decode and continuous batching.

:class:`RolloutEngine` runs Llama-family decoders (Llama, Mistral, Qwen2) with its own forward
(:mod:`rlcore.rollout.llama`) over the Hugging Face module's weights:

* a KV cache for ``max_batch_size`` slots of ``max_seq_len`` tokens is allocated once;
* prompts are prefilled in groups, left padded, positions taken from the attention mask;
* each decode step runs every slot at its own cache column; on CUDA the step is captured in a
  CUDA graph per batch-size bucket and replayed (no per-kernel launch cost);
* sampling (:mod:`rlcore.rollout.sampling`) runs on the device with a seeded generator;
* continuous batching: a finished sequence frees its slot and the next waiting prompt is
  prefilled into it, so a few long answers do not leave the rest of the batch idle; once the
  queue is empty, live slots are compacted so a smaller graph bucket can run.

Works on CPU too (no graphs), which is what the CPU tests and the CPU training demo use.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Sequence

import torch

from rlcore.rollout import llama
from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad, mask_after_eos
from rlcore.rollout.sampling import Sampler, validate_params

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _model_device(model) -> torch.device:
    param = next(model.parameters())
    return param.device


class _Graphs:
    """CUDA graphs of the decode step, one per batch-size bucket, captured on first use."""

    def __init__(self, engine: "RolloutEngine"):
        self.engine = engine
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def run(self, n: int) -> torch.Tensor:
        if n not in self.graphs:
            try:
                self.graphs[n] = self._capture(n)
            except RuntimeError as error:  # capture refused (driver, allocator): run eagerly instead
                log.warning("rollout engine: CUDA graph capture failed (%s); decoding without graphs", error)
                self.engine._graphs = None
                self.engine.use_cuda_graphs = False
                return self.engine._decode_eager(n)
        graph, logits = self.graphs[n]
        graph.replay()
        return logits

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        eng = self.engine
        st = eng.state
        saved = (st.positions[:n].clone(), st.cache_index[:n].clone(), st.bias[:n].clone())
        side = torch.cuda.Stream(device=eng.device)
        side.wait_stream(torch.cuda.current_stream(eng.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: cuBLAS handles and workspaces
                eng._decode_eager(n)
        torch.cuda.current_stream(eng.device).wait_stream(side)
        st.positions[:n].copy_(saved[0])
        st.cache_index[:n].copy_(saved[1])
        st.bias[:n].copy_(saved[2])
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = eng._decode_eager(n)
        log.debug("rollout engine: captured decode graph for batch bucket %d", n)
        return graph, logits

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None


class RolloutEngine:
    """Generate with a static KV cache, CUDA graphs and continuous batching.

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
        max_prefill_tokens: bound on ``prompts x width`` per prefill call (activation memory).
        fused_sampling: on CUDA, sample unfiltered (no top-k/top-p) steps with the one-pass
            Triton kernel (:mod:`rlcore.rollout.fused_sampling`), checked once against PyTorch.
    """

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, use_cuda_graphs: bool = True,
                 graph_batch_buckets: Sequence[int] = DEFAULT_BUCKETS, share_weights: bool | None = None,
                 admit_fraction: float = 0.125, eos_check_interval: int = 8, max_prefill_tokens: int = 65536,
                 fused_sampling: bool = True):
        if max_batch_size < 1:
            raise ValueError(f"RolloutEngine: max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"RolloutEngine: max_seq_len must be >= 2, got {max_seq_len}")
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
        if share_weights is None:
            share_weights = (not self.use_cuda_graphs and self.dtype == next(model.parameters()).dtype
                             and _model_device(model) == self.device)
        self.weights = llama.DecoderWeights.from_model(model, self.dtype, self.device, share=share_weights)
        self.buckets = sorted({b for b in graph_batch_buckets if 0 < b < max_batch_size} | {max_batch_size})
        self.admit_fraction = float(admit_fraction)
        self.eos_check_interval = max(1, int(eos_check_interval))
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.fused_sampling = bool(fused_sampling)
        self._allocate()
        self._graphs = _Graphs(self) if self.use_cuda_graphs else None
        log.info("rollout engine: %d layers, %d slots x %d tokens, %s on %s, cuda graphs %s",
                 self.spec.num_layers, max_batch_size, max_seq_len, self.dtype, self.device,
                 "on" if self.use_cuda_graphs else "off")

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
        if self._graphs is not None and self.weights.pointers() != before:
            self._graphs.clear()  # storage moved: recapture lazily

    def warmup(self) -> None:
        """Capture every bucket's decode graph now instead of on first use."""
        if self._graphs is not None:
            for n in self.buckets:
                self._graphs.run(n)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~rlcore.rollout.base.RolloutBackend`."""
        validate_params(params, self.spec.vocab_size)
        if len(prompts) == 0:
            raise ValueError("RolloutEngine.generate: no prompts given")
        widest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("RolloutEngine.generate: empty prompt")
        if widest + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"RolloutEngine.generate: prompt length {widest} + max_new_tokens "
                             f"{params.max_new_tokens} exceeds max_seq_len {self.max_seq_len}")
        start = time.perf_counter()
        run = _Run(self, prompts, params)
        run.loop()
        batch = run.result()
        batch.stats["rollout/seconds"] = time.perf_counter() - start
        return batch

    # ------------------------------------------------------------------ internals

    def _allocate(self) -> None:
        spec, b, s = self.spec, self.max_batch_size, self.max_seq_len
        dev = self.device
        self.cache = torch.zeros(spec.num_layers, 2, b, spec.num_kv_heads, s, spec.head_dim,
                                 dtype=self.dtype, device=dev)
        slot_rows = torch.arange(b, device=dev)[:, None] * spec.num_kv_heads
        self.state = llama.DecodeState(
            tokens=torch.zeros(b, dtype=torch.long, device=dev),
            positions=torch.zeros(b, dtype=torch.long, device=dev),
            cache_index=torch.zeros(b, dtype=torch.long, device=dev),
            bias=torch.zeros(b, s, dtype=self.dtype, device=dev),
            flat_base=((torch.arange(2, device=dev)[:, None, None] * b * spec.num_kv_heads + slot_rows[None]
                        + torch.arange(spec.num_kv_heads, device=dev)[None, None]) * s),
            zero=torch.zeros(1, 1, dtype=self.dtype, device=dev),
        )
        cos, sin = llama.rope_table(self.model, s, dev)
        self.cos, self.sin = cos, llama.signed_sin(sin)

    def _decode_eager(self, n: int) -> torch.Tensor:
        return llama.decode(self.weights, self.spec, self.cache, self.state, n, self.cos, self.sin)

    def _decode(self, n: int) -> torch.Tensor:
        if self._graphs is not None:
            return self._graphs.run(n)
        return self._decode_eager(n)

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.max_batch_size

    def _prefill(self, slots: list[int], prompts: list[Sequence[int]], pad_id: int) -> torch.Tensor:
        """Prefill ``prompts`` into ``slots`` and reset those slots' decode state. Returns logits."""
        ids, mask = left_pad(prompts, pad_id, self.device)
        width = ids.shape[1]
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        chunk = max(1, self.max_prefill_tokens // width)
        logits = [llama.prefill(self.weights, self.spec, self.cache, rows[i:i + chunk], ids[i:i + chunk],
                                mask[i:i + chunk], self.cos, self.sin) for i in range(0, len(slots), chunk)]
        st = self.state
        bias = torch.full((len(slots), self.max_seq_len), float("-inf"), dtype=self.dtype, device=self.device)
        bias[:, :width].masked_fill_(mask.bool(), 0.0)
        st.bias[rows] = bias
        st.positions[rows] = mask.sum(-1)
        st.cache_index[rows] = width
        return torch.cat(logits)

    def _compact(self, live: list[int]) -> None:
        """Move live slots ``live`` (sorted) to rows ``0..len(live)-1``."""
        m = len(live)
        perm = torch.tensor(live, dtype=torch.long, device=self.device)
        self.cache[:, :, :m] = self.cache.index_select(2, perm)
        st = self.state
        for buf in (st.tokens, st.positions, st.cache_index, st.bias):
            buf[:m] = buf.index_select(0, perm)


class _Run:
    """Scheduler state of one ``generate`` call (slots, queue, outputs)."""

    def __init__(self, engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams):
        self.eng, self.params = engine, params
        self.prompts = [list(p) for p in prompts]
        dev, cap, width = engine.device, engine.max_batch_size, params.max_new_tokens
        self.sample = Sampler(params, dev, fused=engine.fused_sampling)
        self.queue = deque(range(len(prompts)))
        self.slot_req: list[int | None] = [None] * cap
        self.slot_count = [0] * cap
        self.out_tokens = torch.full((cap, width), params.pad_token_id, dtype=torch.long, device=dev)
        self.out_logprobs = torch.zeros(cap, width, dtype=torch.float32, device=dev)
        self.out_col = torch.zeros(cap, dtype=torch.long, device=dev)
        self.done = torch.zeros(cap, dtype=torch.bool, device=dev)
        self.eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=dev)
        self.res_tokens = torch.full((len(prompts), width), params.pad_token_id, dtype=torch.long, device=dev)
        self.res_logprobs = torch.zeros(len(prompts), width, dtype=torch.float32, device=dev)
        self.ar = torch.arange(cap, device=dev)
        self.steps = 0
        self.prefills = 0
        self.bucket_steps: dict[int, int] = {}

    # -- slot bookkeeping
    def live(self) -> list[int]:
        return [s for s, r in enumerate(self.slot_req) if r is not None]

    def _record(self, n: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Write the step's tokens of slots ``0..n-1`` at their output columns."""
        width = self.params.max_new_tokens
        col = self.out_col[:n].clamp(max=width - 1)
        flat = self.ar[:n] * width + col
        self.out_tokens.view(-1).index_copy_(0, flat, tokens)
        self.out_logprobs.view(-1).index_copy_(0, flat, logprobs)
        self.out_col[:n] += 1
        if self.eos.numel():
            self.done[:n] |= torch.isin(tokens, self.eos)

    def _finish(self, slots: list[int]) -> None:
        if not slots:
            return
        rows = torch.tensor(slots, dtype=torch.long, device=self.eng.device)
        reqs = torch.tensor([self.slot_req[s] for s in slots], dtype=torch.long, device=self.eng.device)
        self.res_tokens.index_copy_(0, reqs, self.out_tokens.index_select(0, rows))
        self.res_logprobs.index_copy_(0, reqs, self.out_logprobs.index_select(0, rows))
        for s in slots:
            self.slot_req[s] = None
            self.slot_count[s] = 0

    def _admit(self) -> None:
        free = [s for s, r in enumerate(self.slot_req) if r is None]
        take = min(len(free), len(self.queue))
        slots = free[:take]
        reqs = [self.queue.popleft() for _ in range(take)]
        logits = self.eng._prefill(slots, [self.prompts[r] for r in reqs], self.params.pad_token_id)
        tokens, logprobs = self.sample(logits)
        rows = torch.tensor(slots, dtype=torch.long, device=self.eng.device)
        self.eng.state.tokens[rows] = tokens
        self.done[rows] = torch.isin(tokens, self.eos) if self.eos.numel() else False
        width = self.params.max_new_tokens
        self.out_tokens.view(-1).index_copy_(0, rows * width, tokens)
        self.out_logprobs.view(-1).index_copy_(0, rows * width, logprobs)
        self.out_col[rows] = 1
        for s, r in zip(slots, reqs):
            self.slot_req[s] = r
            self.slot_count[s] = 1
        self.prefills += 1

    def _should_admit(self) -> bool:
        if not self.queue:
            return False
        free = self.slot_req.count(None)
        if free == 0:
            return False
        busy = len(self.slot_req) - free
        return busy == 0 or free >= max(1, int(self.eng.admit_fraction * len(self.slot_req)))

    def _maybe_compact(self) -> None:
        live = self.live()
        if self.queue or not live:
            return
        if self.eng._bucket(len(live)) >= self.eng._bucket(live[-1] + 1):
            return
        self.eng._compact(live)
        perm = torch.tensor(live, dtype=torch.long, device=self.eng.device)
        m = len(live)
        for buf in (self.out_tokens, self.out_logprobs, self.out_col, self.done):
            buf[:m] = buf.index_select(0, perm)
        self.slot_req = [self.slot_req[s] for s in live] + [None] * (len(self.slot_req) - m)
        self.slot_count = [self.slot_count[s] for s in live] + [0] * (len(self.slot_count) - m)

    def loop(self) -> None:
        limit = self.params.max_new_tokens
        while self.queue or self.live():
            if self._should_admit():
                self._admit()
                self._finish([s for s in self.live() if self.slot_count[s] >= limit])
                continue
            self._maybe_compact()
            live = self.live()
            n = self.eng._bucket(live[-1] + 1)
            logits = self.eng._decode(n)
            tokens, logprobs = self.sample(logits)
            self.eng.state.tokens[:n].copy_(tokens)
            self._record(n, tokens, logprobs)
            self.steps += 1
            self.bucket_steps[n] = self.bucket_steps.get(n, 0) + 1
            for s in live:
                self.slot_count[s] += 1
            finished = [s for s in live if self.slot_count[s] >= limit]
            if self.eos.numel() and self.steps % self.eng.eos_check_interval == 0:
                flags = self.done[:n].tolist()
                finished = sorted(set(finished) | {s for s in live if flags[s]})
            self._finish(finished)

    def result(self) -> RolloutBatch:
        eng = self.eng
        prompt_ids, prompt_mask = left_pad(self.prompts, self.params.pad_token_id, eng.device)
        mask = mask_after_eos(self.res_tokens, self.params.eos_token_ids)
        width = int(mask.sum(-1).max().item()) if self.eos.numel() else self.params.max_new_tokens
        tokens = self.res_tokens.masked_fill(mask == 0, self.params.pad_token_id)[:, :width]
        logprobs = (self.res_logprobs * mask)[:, :width]
        stats = {"rollout/decode_steps": float(self.steps), "rollout/prefill_calls": float(self.prefills),
                 "rollout/new_tokens": float(mask.sum().item())}
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens,
                            response_mask=mask[:, :width], logprobs=logprobs, stats=stats)
