"""The default reward backend: precedence, weights, dispatch on data_source, configuration errors."""

from __future__ import annotations

import textwrap

import pytest
import torch

from rlcore.config.schema import RewardConfig, RewardFunctionConfig, RewardModelConfig
from rlcore.distributed.placement import ColocatedPlacement
from rlcore.errors import ConfigError, PlacementError, RewardError
from rlcore.protocols import DistInfo, PlacementRequest, RewardBackend, RewardInput
from rlcore.rewards.backend import build_reward_backend
from rlcore.rewards.rules import BUILTIN_REWARDS


def batch_of(responses, **extras):
    n = len(responses)
    return RewardInput(prompts=["a b c"] * n, responses=list(responses), prompt_ids=[[1]] * n,
                       response_ids=[[2] * max(1, len(r.split())) for r in responses],
                       extras={k: list(v) for k, v in extras.items()})


def backend(path=None, name="compute_score", weights=None, rewards=None, offload=False, rm=False, **reward):
    placement = ColocatedPlacement(PlacementRequest(reward="cpu", reward_offload=offload), DistInfo())
    return build_reward_backend(RewardModelConfig(enable=rm, offload=offload),
                                RewardFunctionConfig(path=path, name=name),
                                RewardConfig(weights=dict(weights or {}), **reward), placement, None,
                                dict(BUILTIN_REWARDS if rewards is None else rewards))


@pytest.fixture
def custom_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        def compute_score(prompt, response, ground_truth=None):
            return 10.0 if response == ground_truth else 0.0
    """))
    return str(path)


def test_custom_function_takes_precedence(custom_fn):
    be = backend(custom_fn)
    assert isinstance(be, RewardBackend)
    out = be.score(batch_of(["x", "y"], ground_truth=["x", "x"], data_source=["gsm8k", "gsm8k"]))
    assert out.scores.dtype == torch.float32 and out.scores.shape == (2,)
    assert out.scores.tolist() == [10.0, 0.0] and out.metrics["reward/compute_score"] == 5.0


def test_weighted_sum_logs_each_component():
    be = backend(weights={"exact_match": 1.0, "format_penalty": 0.5})
    out = be.score(batch_of(["#### 4", "4"], ground_truth=["#### 4", "#### 4"]))
    # sample 0: exact 1, format 0; sample 1: exact 0, format -1
    assert out.scores.tolist() == [1.0, -0.5]
    assert out.metrics["reward/exact_match"] == 0.5 and out.metrics["reward/format_penalty"] == -0.5


def test_custom_function_joins_weights_by_name(custom_fn):
    be = backend(custom_fn, weights={"compute_score": 0.1, "length_penalty": 1.0})
    out = be.score(batch_of(["x"], ground_truth=["x"]))
    assert out.scores.tolist() == [pytest.approx(1.0)]
    with pytest.raises(RewardError, match="does not mention the custom function 'compute_score'"):
        backend(custom_fn, weights={"exact_match": 1.0})


def test_unknown_weight_names_are_suggested():
    with pytest.raises(RewardError, match=r"'exact_mach' \(did you mean 'exact_match'\?\).*registered rewards"):
        backend(weights={"exact_mach": 1.0})
    with pytest.raises(RewardError, match="reward.weights.rm is set but reward_model.enable is false"):
        backend(weights={"rm": 1.0, "exact_match": 1.0})


def test_dispatch_on_data_source_then_exact_match():
    be = backend()
    batch = batch_of(["5\n#### 5", "#### 5", "Paris", "\\boxed{1/2}"],
                     data_source=["openai/gsm8k", "gsm8k", "trivia", "math_equiv"],
                     ground_truth=["#### 5", "6", "paris", "0.5"])
    out = be.score(batch)
    assert out.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out.metrics["reward/gsm8k"] == 0.5 and out.metrics["reward/exact_match"] == 1.0
    assert out.metrics["reward/math_equiv"] == 1.0


def test_dispatch_runs_a_registered_reward_by_name():
    def echo_len(prompts, responses, **_):
        return [float(len(r)) for r in responses]

    out = backend(rewards={"mytask": echo_len}).score(batch_of(["abc", "x"], data_source=["mytask", "mytask"]))
    assert out.scores.tolist() == [3.0, 1.0]


def test_no_reward_for_a_sample_explains_how_to_configure():
    be = backend()
    with pytest.raises(RewardError, match=r"(?s)no reward for sample 1: its data_source 'mystery'.*reward.weights"):
        be.score(batch_of(["a", "b"], data_source=["exact_match", "mystery"], ground_truth=["a", None]))
    with pytest.raises(RewardError, match="there is no data_source column"):
        be.score(batch_of(["a"]))


def test_fallback_and_error_counter(tmp_path):
    path = tmp_path / "fragile.py"
    path.write_text("def compute_score(prompt, response):\n    return 1.0 / len(response)\n")
    with pytest.raises(RewardError, match="failed on sample 1: ZeroDivisionError"):
        backend(str(path)).score(batch_of(["ab", ""]))
    out = backend(str(path), fallback_score=-1.0).score(batch_of(["ab", ""]))
    assert out.scores.tolist() == [0.5, -1.0] and out.metrics["reward/errors"] == 1.0


def test_config_errors_are_reported_together():
    with pytest.raises(ConfigError) as err:
        backend(num_workers=-1, timeout_s=0, weights={"exact_match": "heavy"})
    assert len(err.value.problems) == 3


def test_offload_without_the_plugin_is_an_error():
    with pytest.raises(PlacementError, match="needs the 'rm-offload' plugin"):
        backend(rm=True, offload=True)


def test_mismatched_batch_lists():
    bad = RewardInput(prompts=["a"], responses=["a", "b"], prompt_ids=[[1], [1]], response_ids=[[1], [1]])
    with pytest.raises(RewardError, match="2 responses but 1 prompts"):
        backend(weights={"length_penalty": 1.0}).score(bad)


def test_defaults_plugin_builds_it(rlcore_pm):
    rewards = {}
    rlcore_pm.hook.rlcore_register_rewards(register=lambda n, f: rewards.__setitem__(n, f))
    placement = ColocatedPlacement(PlacementRequest(), DistInfo())
    be = rlcore_pm.build("rlcore_reward_backend", reward_model=RewardModelConfig(),
                         reward_function=RewardFunctionConfig(), reward=RewardConfig(), placement=placement,
                         tokenizer=None, rewards=rewards, run_dir="")
    assert be.score(batch_of(["x"], ground_truth=["x"])).scores.tolist() == [1.0]
