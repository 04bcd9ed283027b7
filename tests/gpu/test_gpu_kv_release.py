"""On a CUDA machine: the KV cache handed back between rollouts (CUDA's virtual memory API through
``rlcore.rollout.engine.vmem``) frees device memory, is taken again at the same addresses, and a
CUDA graph captured before the release still writes and reads it. Skipped without CUDA."""

import pytest
import torch

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.engine import vmem
from rlcore.rollout.tiny import tiny_causal_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GIB = 1 << 30


def test_release_frees_device_memory_and_acquire_keeps_the_address():
    kv = vmem.zeros((GIB // 2,), torch.bfloat16, "cuda", True)  # 1 GiB
    assert kv.releasable and kv.tensor.is_cuda and kv.tensor.data_ptr() % 4096 == 0
    address = kv.tensor.data_ptr()
    kv.tensor.fill_(3.0)
    free_before, _ = torch.cuda.mem_get_info()
    assert kv.release() >= GIB
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after - free_before >= GIB - (64 << 20)
    other = torch.ones(GIB // 4, dtype=torch.float32, device="cuda")  # the update may take that memory now
    del other
    kv.acquire()
    assert kv.tensor.data_ptr() == address
    assert int(kv.tensor.count_nonzero()) == 0


def test_a_graph_captured_before_the_release_runs_after_it():
    kv = vmem.zeros((1 << 20,), torch.float32, "cuda", True)
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    out = torch.empty_like(src)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kv.tensor.copy_(src)  # warm-up outside the capture
        out.copy_(kv.tensor * 2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv.tensor.add_(src)
        out.copy_(kv.tensor * 2)
    kv.release()
    kv.acquire()  # zeroed
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, src * 2)


def test_engine_decodes_the_same_after_a_release():
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen2").to("cuda", torch.bfloat16)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3]]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    kept = RolloutEngine(model, max_batch_size=4, max_seq_len=32, release_kv=False).generate(prompts, params)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=32, release_kv=True)
    first = engine.generate(prompts, params)
    assert engine.release_kv() >= engine.kv_bytes and engine.kv_released
    second = engine.generate(prompts, params)  # the captured decode graphs replay on the memory taken again
    assert second.stats["rollout/kv_acquire_s"] > 0
    for got in (first, second):
        assert torch.equal(got.response_ids, kept.response_ids)
        assert torch.equal(got.logprobs, kept.logprobs)
