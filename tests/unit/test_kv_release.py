"""The KV cache handed back between rollouts (``actor.rollout_engine.release_kv``) and taken again.

CUDA's virtual memory calls are replaced by a driver that keeps "physical memory" in CPU buffers, so
the state machine, the zeroing after a release and the engine's wiring run on CPU; the real calls
run in ``tests/gpu/test_gpu_kv_release.py``."""

from __future__ import annotations

import pytest
import torch

from rlcore.errors import PluginError

from rlcore.rollout.base import RolloutBatch, SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.engine import vmem
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import generation

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


class FakeDriver:
    """Addresses are offsets into one CPU buffer; unmapping fills the bytes with NaN patterns (what
    reads of a released range would see, instead of a fault) and frees the "physical" budget."""

    def __init__(self, capacity: int = 1 << 30, grain: int = 4096, fail_create: int = 0):
        self.buffer = torch.zeros(0, dtype=torch.uint8)
        self.capacity, self.grain, self.fail_create = capacity, grain, fail_create
        self.in_use, self.handles, self.calls = 0, {}, []
        self.ranges: dict[int, int] = {}

    def granularity(self) -> int:
        return self.grain

    def reserve(self, size: int, alignment: int) -> int:
        assert size % alignment == 0
        ptr = 1 << 20
        self.ranges[ptr] = size
        self.buffer = torch.full((size,), 0xFF, dtype=torch.uint8)
        self.calls.append("reserve")
        return ptr

    def free_range(self, ptr: int, size: int) -> None:
        assert self.ranges.pop(ptr) == size
        self.calls.append("free_range")

    def create(self, size: int) -> int:
        if self.fail_create or self.in_use + size > self.capacity:
            self.fail_create = max(0, self.fail_create - 1)
            raise vmem.DriverError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        self.in_use += size
        handle = len(self.handles) + 1
        self.handles[handle] = size
        self.calls.append("create")
        return handle

    def map(self, ptr: int, size: int, handle: int) -> None:
        assert self.handles[handle] == size and self.ranges[ptr] == size
        self.calls.append("map")

    def unmap(self, ptr: int, size: int) -> None:
        self.buffer.fill_(0xFF)  # bf16/float32 0xFF.. bytes are NaN: stale reads would show
        self.calls.append("unmap")

    def release(self, handle: int) -> None:
        self.in_use -= self.handles.pop(handle)
        self.calls.append("release")

    def view(self, ptr: int, size: int, device, on_free) -> torch.Tensor:
        return self.buffer[:size]


def test_release_then_acquire_zeroes_at_the_same_storage():
    driver = FakeDriver()
    kv = vmem.Releasable((3, 5), torch.float32, torch.device("cpu"), driver)
    assert kv.releasable and kv.mapped and kv.size % driver.grain == 0 and kv.size >= kv.nbytes == 60
    assert torch.equal(kv.tensor, torch.zeros(3, 5))
    kv.tensor.fill_(2.0)
    address = kv.tensor.data_ptr()
    assert kv.release() == kv.size and not kv.mapped and driver.in_use == 0
    assert kv.release() == 0  # already released
    assert torch.isnan(kv.tensor).all()  # the contents are gone (a real device would fault)
    kv.acquire()
    assert kv.mapped and driver.in_use == kv.size and kv.tensor.data_ptr() == address
    assert torch.equal(kv.tensor, torch.zeros(3, 5))
    assert driver.calls == ["reserve", "create", "map", "unmap", "release", "create", "map"]
    kv.acquire()  # mapped: nothing to do
    assert driver.calls.count("create") == 2 and kv.releases == 1


def test_acquire_out_of_memory_names_the_setting_and_retries_once():
    driver = FakeDriver()
    kv = vmem.Releasable((16,), torch.float32, torch.device("cpu"), driver)
    kv.release()
    driver.fail_create = 1  # the first try fails, the one after the garbage collection succeeds
    kv.acquire()
    assert kv.mapped
    kv.release()
    driver.fail_create = 2
    with pytest.raises(torch.OutOfMemoryError, match="release_kv=false"):
        kv.acquire()
    assert not kv.mapped


def test_other_driver_errors_pass_through():
    driver = FakeDriver()
    kv = vmem.Releasable((16,), torch.float32, torch.device("cpu"), driver)
    kv.release()

    def broken(size):
        raise vmem.DriverError("cuMemCreate", 1, "CUDA_ERROR_INVALID_VALUE")

    driver.create = broken
    with pytest.raises(vmem.DriverError, match="INVALID_VALUE"):
        kv.acquire()


def test_plain_tensor_where_the_device_cannot_release():
    kv = vmem.zeros((2, 3), torch.bfloat16, "cpu", None)
    assert not kv.releasable and kv.mapped and kv.release() == 0
    assert kv.tensor.dtype == torch.bfloat16 and torch.equal(kv.tensor, torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="release_kv=true"):
        vmem.zeros((2, 3), torch.float32, "cpu", True)
    assert not vmem.zeros((2, 3), torch.float32, "cpu", False).releasable


def test_range_close_unmaps_and_frees():
    driver = FakeDriver()
    rng = vmem._Range(driver, 8192, 4096)
    rng.map()
    rng.close()
    assert driver.calls == ["reserve", "create", "map", "unmap", "release", "free_range"] and driver.in_use == 0
    rng.close()  # twice: nothing more
    assert driver.calls.count("free_range") == 1


@pytest.fixture()
def fake_driver(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(vmem, "driver_for", lambda device: driver)
    return driver


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_engine_releases_and_takes_its_cache_again(fake_driver, kv_cache):
    model = tiny_causal_lm("qwen2")
    expected = RolloutEngine(model, max_batch_size=4, max_seq_len=24, kv_cache=kv_cache,
                             release_kv=False).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=24, kv_cache=kv_cache, release_kv=None)
    assert engine._kv.releasable and not engine.kv_released
    first = engine.generate(PROMPTS, GREEDY)
    assert first.stats["rollout/kv_acquire_s"] == 0.0
    freed = engine.release_kv()
    assert freed >= engine.kv_bytes > 0 and engine.kv_released and fake_driver.in_use == 0
    assert torch.isnan(engine.cache).all()
    second = engine.generate(PROMPTS, GREEDY)  # takes the cache again, zeroed, before any use
    assert not engine.kv_released and second.stats["rollout/kv_acquire_s"] > 0.0
    for got in (first, second):
        assert torch.equal(got.response_ids, expected.response_ids)
        assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-5)
    engine.release_kv()
    engine.warmup([2])  # warm-up (graph capture on CUDA) takes it too
    assert not engine.kv_released


def test_engine_refuses_required_release_it_cannot_do():
    with pytest.raises(ValueError, match="release_kv=true"):
        RolloutEngine(tiny_causal_lm("qwen2"), max_batch_size=2, max_seq_len=16, release_kv=True)
    for setting in (None, False):  # the default (where the device can) on CPU, and off: kept
        engine = RolloutEngine(tiny_causal_lm("qwen2"), max_batch_size=2, max_seq_len=16, release_kv=setting)
        assert engine.release_kv() == 0 and not engine.kv_released
    assert "rollout/kv_acquire_s" not in engine.generate(PROMPTS[:2], GREEDY).stats


class _Backend:
    continuous_batching = True

    def __init__(self, freed):
        self.freed, self.calls = freed, []

    def generate(self, prompts, params):
        self.calls.append("generate")
        n = len(prompts)
        ids = torch.ones(n, 2, dtype=torch.long)
        return RolloutBatch(prompt_ids=ids, prompt_mask=torch.ones_like(ids), response_ids=ids,
                            response_mask=torch.ones_like(ids), logprobs=torch.zeros(n, 2))

    def sync_weights(self):
        pass

    def release_kv(self):
        self.calls.append("release_kv")
        return self.freed


class _Reshard:
    from contextlib import contextmanager

    @contextmanager
    def generation(self, actor):
        yield actor

    def generation_share(self, prompts, params):
        from rlcore.protocols import GenerationShare

        return GenerationShare(prompts=list(prompts), params=params)


@pytest.mark.parametrize("freed", [0, 1 << 30])
def test_the_trainer_releases_after_each_rollout(freed):
    backend = _Backend(freed)
    actor = torch.nn.Linear(2, 2)
    gen = generation.ActorGeneration(actor, _Reshard(), lambda module, tp: backend, micro_batch=8)
    batch = gen.generate([[1], [2], [3]], GREEDY)
    assert backend.calls == ["generate", "release_kv"]
    assert batch.stats.get("rollout/kv_released_bytes", 0.0) == float(freed)


@pytest.mark.parametrize("bad", [None, -1, 1.5, True])
def test_a_backend_release_answer_is_checked(bad):
    backend = _Backend(bad)
    gen = generation.ActorGeneration(torch.nn.Linear(2, 2), _Reshard(), lambda module, tp: backend, micro_batch=8)
    with pytest.raises(PluginError, match=r"plugin '_Backend'.*_Backend\.release_kv\(\) returned"):
        gen.generate([[1]], GREEDY)
    # with the trainer's contract the error names the plugin that built the backend
    from rlcore.contract import RolloutContract

    contract = RolloutContract(names={id(backend): "my-engine"})
    gen = generation.ActorGeneration(torch.nn.Linear(2, 2), _Reshard(), lambda module, tp: backend, micro_batch=8,
                                     contract=contract)
    with pytest.raises(PluginError, match="plugin 'my-engine'"):
        gen.generate([[1]], GREEDY)


def test_the_default_releases_where_the_device_can_and_keeps_the_cache_elsewhere(fake_driver):
    from rlcore.config.schema import RolloutEngineConfig

    setting = RolloutEngineConfig().engine_kwargs()["release_kv"]
    engine = RolloutEngine(tiny_causal_lm("qwen2"), max_batch_size=2, max_seq_len=16, release_kv=setting)
    assert setting is None and engine._kv.releasable and engine.release_kv() > 0 and engine.kv_released
    fake_driver.calls.clear()
    off = RolloutEngine(tiny_causal_lm("qwen2"), max_batch_size=2, max_seq_len=16,
                        release_kv=RolloutEngineConfig(release_kv=False).engine_kwargs()["release_kv"])
    assert not off._kv.releasable and off.release_kv() == 0 and fake_driver.calls == []
