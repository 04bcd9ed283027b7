"""``actor.rollout_engine``: the engine's settings as a typed section of the schema, checked when the
config loads (each problem naming its key) and handed to the engine the trainer builds."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from rlcore.config import load_config
from rlcore.config.schema import RolloutEngineConfig
from rlcore.distributed.init import DistInfo
from rlcore.errors import ConfigError
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import components


def _engine(cfg):
    """The rollout backend the trainer builds (through rlcore_rollout_backend) for a tiny model."""
    from rlcore.config.schema import FSDPConfig
    from rlcore.distributed.reshard import FSDPReshardPolicy
    from rlcore.plugin_manager import build_plugin_manager

    model = tiny_causal_lm("qwen2")
    generation = components._generation(build_plugin_manager([]), model, model,
                                        FSDPReshardPolicy(FSDPConfig(), DistInfo()), components.obj(cfg.actor),
                                        components.obj(cfg.data), components.obj(cfg.ppo), DistInfo())
    return generation.backend(model)


def test_settings_reach_the_engine_the_trainer_builds():
    engine = _engine(load_config([], [
        "actor.rollout_backend=engine", "actor.rollout_engine.attention=sdpa",
        "actor.rollout_engine.eos_check_interval=3", "actor.rollout_engine.graph_batch_buckets=[2]",
        "actor.rollout_engine.split_k.down=2", "actor.rollout_engine.attention_tuning.num_warps=4",
        "actor.rollout_engine.attention_tuning.max_chunk=512",
        "actor.rollout_engine.mlp_transposed=true", "actor.rollout_engine.page_size=16",
        "actor.rollout_engine.kv_pages=5", "ppo.generation.batch_size=4",
        "ppo.generation.max_new_tokens=8", "data.max_prompt_length=16"]))
    assert isinstance(engine, RolloutEngine)
    assert (engine.attention, engine.eos_check_interval, engine.buckets) == ("sdpa", 3, [2, 4])
    assert engine.split_k == (1, 1, 2, 1) and engine.attention_tuning == {"num_warps": 4, "max_chunk": 512}
    assert engine.mlp_transposed is True
    assert (engine.max_batch_size, engine.max_seq_len) == (4, 24)  # still the trainer's
    assert engine.paged and (engine.page_size, engine.pool.pages) == (16, 5)


def test_the_engine_keeps_the_updates_future_memory_out_of_its_kv_pool():
    """The gradients and AdamW moments the first update will allocate are left out of the free memory
    the page pool is sized from; a resumed optimizer's moments (already allocated) are not counted again."""
    import torch

    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.config.schema import FSDPConfig
    from rlcore.distributed.reshard import FSDPReshardPolicy
    from rlcore.rollout.engine import pages

    cfg = load_config([], ["actor.rollout_backend=engine", "ppo.generation.batch_size=2",
                           "ppo.generation.max_new_tokens=8", "data.max_prompt_length=8"])
    model = tiny_causal_lm("qwen2")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())

    def engine():
        generation = components._generation(build_plugin_manager([]), model, model,
                                            FSDPReshardPolicy(FSDPConfig(), DistInfo()), components.obj(cfg.actor),
                                            components.obj(cfg.data), components.obj(cfg.ppo), DistInfo(),
                                            trained=[(model, optimizer)])
        return generation.backend(model)

    assert engine().kv_reserve_bytes == 3 * weights  # gradients + two moments, none allocated yet
    model(torch.tensor([[1, 2, 3]])).logits.float().sum().backward()
    optimizer.step()
    assert engine().kv_reserve_bytes == 0  # both already allocated: the free memory shows them
    # the pool takes its share of the free memory less the reserve
    per_page = pages.page_bytes(28, 4, 64, 128, torch.bfloat16)
    cuda = torch.device("cuda")
    sized = dict(slots=256, max_seq_len=8704, page_size=64, bytes_per_page=per_page, device=cuda, kv_pages=None,
                 fraction=0.5, free_bytes=100 * 2**30)
    assert pages.pool_pages(**sized, reserve_bytes=40 * 2**30) == int(30 * 2**30) // per_page
    with pytest.raises(ValueError, match="less 99.90 GiB kept for the update"):
        pages.pool_pages(**sized, reserve_bytes=int(99.9 * 2**30))


def test_default_engine_settings_are_the_engines_defaults():
    engine = _engine(load_config([], ["actor.rollout_backend=engine"]))
    assert engine.eos_check_interval == 8 and engine.attention_tuning == {}
    kwargs = RolloutEngineConfig().engine_kwargs()
    defaults = {name: p.default for name, p in inspect.signature(RolloutEngine.__init__).parameters.items()}
    for name, value in kwargs.items():
        expected = defaults[name]
        if name == "graph_batch_buckets":
            expected = list(expected)
        if name == "attention_tuning":
            expected = {}
        assert value == expected, name


@pytest.mark.parametrize("override, key, words", [
    ("actor.rollout_engine.atention=triton", "actor.rollout_engine.atention", "did you mean 'actor.rollout_engine.attention'"),
    ("actor.rollout_engine.max_batch_size=8", "actor.rollout_engine.max_batch_size", "unknown key"),
    ("actor.rollout_engine.attention=flash", "actor.rollout_engine.attention", "'flash' is not one of auto, sdpa, triton"),
    ("actor.rollout_engine.attention=matmul", "actor.rollout_engine.attention", "is not one of"),
    ("actor.rollout_engine.compile_mode=fast", "actor.rollout_engine.compile_mode", "'fast' is not one of"),
    ("actor.rollout_engine.attention_tuning.warps=2", "actor.rollout_engine.attention_tuning.warps",
     "did you mean 'actor.rollout_engine.attention_tuning.num_warps'"),
    ("actor.rollout_engine.attention_tuning.subblocks=3", "actor.rollout_engine.attention_tuning",
     "attention_tuning['subblocks']"),
    ("actor.rollout_engine.attention_tuning.max_chunk=-1", "actor.rollout_engine.attention_tuning",
     "attention_tuning['max_chunk']"),
    ("actor.rollout_engine.split_k.down=0", "actor.rollout_engine.split_k", "split_k['down']"),
    ("actor.rollout_engine.split_k.up=2", "actor.rollout_engine.split_k.up", "unknown key"),
    ("actor.rollout_engine.mlp_transposed=maybe", "actor.rollout_engine.mlp_transposed", "bad value"),
    ("actor.rollout_engine.eos_check_interval=0", "actor.rollout_engine.eos_check_interval", "must be >= 1"),
    ("actor.rollout_engine.admit_fraction=1.5", "actor.rollout_engine.admit_fraction", "must be in (0, 1]"),
    ("actor.rollout_engine.kv_cache=dynamic", "actor.rollout_engine.kv_cache", "'dynamic' is not one of paged, static"),
    ("actor.rollout_engine.page_size=48", "actor.rollout_engine.page_size", "a power of two >= 16"),
    ("actor.rollout_engine.page_size=32", "actor.rollout_engine.page_size", "block of 64 columns"),
    ("actor.rollout_engine.kv_pages=1", "actor.rollout_engine.kv_pages", "must be >= 2 or null"),
    ("actor.rollout_engine.kv_memory_fraction=0", "actor.rollout_engine.kv_memory_fraction", "must be in (0, 1]"),
])
def test_bad_settings_fail_when_the_config_loads_naming_the_key(override, key, words):
    with pytest.raises(ConfigError) as caught:
        load_config([], [override])
    assert f"'{key}'" in str(caught.value) and words in str(caught.value)


def test_small_pages_go_with_sdpa_or_a_smaller_kernel_block():
    for extra in (["actor.rollout_engine.attention=sdpa"], ["actor.rollout_engine.attention_tuning.block_n=32"],
                  ["actor.rollout_engine.kv_cache=static"]):
        cfg = load_config([], ["actor.rollout_engine.page_size=32", *extra])
        assert cfg.actor.rollout_engine.page_size == 32


def test_every_setting_is_an_engine_argument():
    arguments = inspect.signature(RolloutEngine.__init__).parameters
    names = set(RolloutEngineConfig().engine_kwargs())
    assert names == {f.name for f in dataclasses.fields(RolloutEngineConfig)}
    assert names <= set(arguments)
    assert not names & {"model", "max_batch_size", "max_seq_len", "device", "dtype"}


def test_float32_partials_are_probed_on_cuda_only():
    """Off CUDA the split-K partials keep the compute dtype and the probe does not turn them on."""
    from rlcore.rollout.engine import decode

    before = decode.FLOAT32_PARTIALS
    assert decode.probe_float32_partials(torch.device("cpu")) is before
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    parts = decode._partials(x, w, None, 2)
    assert parts.shape == (2, 4, 6) and parts.dtype == torch.bfloat16
    torch.testing.assert_close(parts.float().sum(0), (x.float() @ w.float().T), atol=0.1, rtol=0.05)
