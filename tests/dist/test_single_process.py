"""The distributed helpers in one process (no torchrun): they must be cheap no-ops or clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore.config.schema import DataConfig, FSDPConfig
from rlcore.distributed import fsdp as F
from rlcore.distributed import init as dinit
from rlcore.distributed import launch
from rlcore.errors import ConfigError, PlacementError, RLCoreError
from rlcore.protocols import DistInfo

TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")


@pytest.fixture
def no_torchrun(monkeypatch):
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_single_process_without_torchrun(no_torchrun):
    info = dinit.init_distributed("cpu")
    assert info == DistInfo(device=torch.device("cpu"))
    assert not info.distributed and info.is_main
    assert dinit.all_reduce_mean({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}
    assert dinit.broadcast_object({"x": 1}) == {"x": 1}
    assert dinit.all_gather_object(3) == [3]
    dinit.barrier()
    dinit.destroy()
    if not torch.cuda.is_available():
        assert dinit.init_distributed("auto").device == torch.device("cpu")
        with pytest.raises(PlacementError, match="no CUDA GPU"):
            dinit.init_distributed("cuda")


def test_bad_device_and_environment(no_torchrun):
    with pytest.raises(PlacementError, match="trainer.device = 'tpu'"):
        dinit.init_distributed("tpu")
    no_torchrun.setenv("WORLD_SIZE", "two")
    with pytest.raises(PlacementError, match="WORLD_SIZE='two' is not an integer"):
        dinit.init_distributed("cpu")


def test_collective_timeout(monkeypatch):
    monkeypatch.delenv(dinit.ENV_TIMEOUT, raising=False)
    assert dinit.collective_timeout().total_seconds() == dinit.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(dinit.ENV_TIMEOUT, "42")
    assert dinit.collective_timeout().total_seconds() == 42
    for bad in ("soon", "-1"):
        monkeypatch.setenv(dinit.ENV_TIMEOUT, bad)
        with pytest.raises(PlacementError, match=dinit.ENV_TIMEOUT):
            dinit.collective_timeout()


def test_error_file_is_what_torch_elastic_reads(tmp_path):
    path = tmp_path / "error.json"
    dinit.write_error_file(str(path), ValueError("bad rank"), "Traceback ...\nValueError: bad rank\n")
    record = json.loads(path.read_text())["message"]
    assert record["message"] == "ValueError: bad rank"
    assert "Traceback" in record["extraInfo"]["py_callstack"]
    assert int(record["extraInfo"]["timestamp"]) > 0


def test_launch_only_when_asked_and_not_already_launched(no_torchrun):
    assert launch.maybe_launch(1, ["trainer.max_steps=1"]) is None
    with pytest.raises(RLCoreError, match="nproc_per_node must be >= 1"):
        launch.maybe_launch(0, [])
    no_torchrun.setenv("LOCAL_RANK", "0")
    assert launch.under_launcher()
    assert launch.maybe_launch(4, []) is None  # a worker never launches again
    args = launch.launcher_args(2, ["cfg.yaml", "trainer.nproc_per_node=2"])
    assert args[:2] == ["--standalone", "--nproc_per_node=2"]
    assert args[-5:] == ["-m", "rlcore", "train", "cfg.yaml", "trainer.nproc_per_node=2"]
    from torch.distributed.run import parse_args

    parsed = parse_args(args)
    assert parsed.module and parsed.training_script == "rlcore" and parsed.nproc_per_node == "2"


def test_a_stop_signal_to_the_launcher_is_a_graceful_end(no_torchrun, caplog):
    import logging

    import torch.distributed.run as trun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from rlcore.errors import EXIT_INTERRUPTED

    def stopped(args):
        raise SignalException("got signal: 15", sigval=15)

    no_torchrun.setattr(trun, "run", stopped)
    no_torchrun.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    with caplog.at_level(logging.WARNING):
        assert launch.maybe_launch(2, ["trainer.max_steps=1"]) == EXIT_INTERRUPTED
    import os

    # the workers get time for their step and checkpoint (torch's own default is 30 s)
    assert os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(launch.SHUTDOWN_TIMEOUT_S)
    assert "stopped by signal 15" in caplog.text
    no_torchrun.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
    launch.maybe_launch(2, [])
    assert os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "5"  # the user's setting wins


def test_fsdp_config_mapping():
    assert F.RESHARD_AFTER_FORWARD == {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False,
                                       "HYBRID_SHARD": True}
    mp = F.mixed_precision(FSDPConfig(param_dtype="bf16", reduce_dtype="fp32"))
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    mp = F.mixed_precision(FSDPConfig(param_dtype="fp32", reduce_dtype="fp32"))
    assert mp.param_dtype is None and mp.reduce_dtype is None
    with pytest.raises(ConfigError, match="'actor.fsdp.reduce_dtype' = 'fp8'"):
        F.check_fsdp_config(FSDPConfig(reduce_dtype="fp8"), "actor.fsdp")


def test_hybrid_shard_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert F.hybrid_shard_size(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert F.hybrid_shard_size(8) == 8


def test_decoder_layers_and_checkpointing():
    from rlcore.rollout.tiny import tiny_causal_lm
    from rlcore.trainer.models import ValueModel

    lm = tiny_causal_lm("qwen2")
    assert F.decoder_layers(lm) == list(lm.model.layers)
    critic = ValueModel.from_causal_lm(tiny_causal_lm("llama"))
    assert len(F.decoder_layers(critic)) == 2
    F.enable_gradient_checkpointing(lm)
    assert getattr(lm, "is_activation_checkpointing", None) or lm.is_gradient_checkpointing

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    plain = Plain()
    x = torch.randn(3, 4)
    want = plain(x)
    F.enable_gradient_checkpointing(plain)
    assert "Checkpoint" in type(plain.layers[0]).__name__
    got = plain(x)
    got.sum().backward()
    assert torch.allclose(got, want)
    with pytest.raises(ConfigError, match="no decoder layers"):
        F.enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_load_model_for_role_single_process_loads_once():
    calls = []
    model = F.load_model_for_role(lambda: calls.append(1) or torch.nn.Linear(2, 2), FSDPConfig(), DistInfo())
    assert isinstance(model, torch.nn.Linear) and calls == [1]


@pytest.mark.parametrize("world", [2, 4])
def test_prompt_loader_gives_each_rank_distinct_rows(world):
    from rlcore.data.loader import PromptLoader

    rows = [{"prompt": f"row {i}", "input_ids": [i + 1]} for i in range(24)]
    seen = []
    for rank in range(world):
        loader = PromptLoader(rows, DataConfig(shuffle=True), 3, 7, DistInfo(rank=rank, world_size=world))
        seen.append([r["prompt"] for _ in range(2) for r in loader.next_batch()])
    flat = [r for part in seen for r in part]
    assert len(flat) == len(set(flat)) == world * 6


def test_ranks_other_than_0_keep_only_warnings():
    import logging

    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    level = root.level
    try:
        root.setLevel(logging.INFO)
        info = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        warning = logging.LogRecord("x", logging.WARNING, __file__, 1, "m", None, None)
        dinit.quiet_other_ranks(0)
        assert handler.filter(info)
        dinit.quiet_other_ranks(1)
        dinit.quiet_other_ranks(1)
        assert not handler.filter(info) and handler.filter(warning) and len(handler.filters) == 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
