"""Loading reward functions, calling conventions, bad input, and the worker pool."""

from __future__ import annotations

import math
import textwrap

import pytest

from rlcore.errors import RewardError
from rlcore.protocols import RewardInput
from rlcore.rewards.functions import FunctionReward, call_style, load_function
from rlcore.rewards.pool import WorkerPool


def make_batch(responses, **extras):
    n = len(responses)
    prompts = [f"q{i}" for i in range(n)]
    return RewardInput(prompts=prompts, responses=list(responses), prompt_ids=[[1, 2]] * n,
                       response_ids=[[3] * (i + 1) for i in range(n)], extras={k: list(v) for k, v in extras.items()})


def write(tmp_path, source, name="reward_fn.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# -- loading ------------------------------------------------------------------------------------


def test_load_from_file_and_module(tmp_path):
    path = write(tmp_path, """
        def compute_score(prompt, response, ground_truth):
            return float(response == ground_truth)
    """)
    fn = load_function(path, "compute_score")
    assert fn(prompt="", response="a", ground_truth="a") == 1.0
    from rlcore.rewards.rules import gsm8k

    assert load_function("rlcore.rewards.rules", "gsm8k") is gsm8k
    assert load_function("pkg://rlcore.rewards.rules", "gsm8k") is gsm8k


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(RewardError, match="does not exist"):
        load_function(str(tmp_path / "missing.py"), "f")
    with pytest.raises(RewardError, match="neither a file nor an importable module"):
        load_function("no_such_package_xyz.rewards", "f")
    path = write(tmp_path, "def score_a(prompts, responses):\n    return [0.0] * len(responses)\n")
    with pytest.raises(RewardError, match=r"defines no function 'compute_score' \(functions there: score_a\)"):
        load_function(path, "compute_score")
    broken = write(tmp_path, "import does_not_exist_zz\n", name="broken.py")
    with pytest.raises(RewardError, match="importing .*broken.py.* failed: ModuleNotFoundError"):
        load_function(broken, "f")


# -- calling convention -------------------------------------------------------------------------


def test_call_style_rule():
    def batched(prompts, responses, **kw): ...
    def per_sample(prompt, response): ...
    def verl_style(data_source, solution_str, ground_truth, extra_info=None): ...
    def only_kwargs(**kw): ...
    def flagged(prompts, responses): ...
    flagged.per_sample = True

    assert not call_style(batched, "b").per_sample
    assert call_style(per_sample, "p").per_sample
    assert call_style(verl_style, "v").per_sample
    assert not call_style(only_kwargs, "k").per_sample
    assert call_style(flagged, "f").per_sample  # the attribute wins over the names
    style = call_style(verl_style, "v")
    assert style.required == {"data_source", "solution_str", "ground_truth"} and not style.var_kw


def test_arguments_passed_are_those_accepted():
    seen = {}

    def strict(prompt, response, response_ids, ground_truth):
        seen.update(prompt=prompt, response_ids=response_ids, gt=ground_truth)
        return len(response_ids)

    def loose(prompts, responses, **kw):
        seen["loose"] = sorted(kw)
        return [0.0] * len(responses)

    batch = make_batch(["a", "bb"], ground_truth=["x", "y"], data_source=["d", "d"])
    assert FunctionReward("s", strict)(batch).scores == [1.0, 2.0]
    assert seen["prompt"] == "q1" and seen["gt"] == "y" and seen["response_ids"] == [3, 3]
    FunctionReward("l", loose, kwargs={"scale": 2})(batch)
    assert seen["loose"] == ["data_source", "ground_truth", "prompt_ids", "response_ids", "scale"]


def test_missing_required_argument_lists_the_columns():
    def needs_label(prompt, response, label):
        return 1.0

    with pytest.raises(RewardError, match=r"needs argument\(s\) label.*available: .*ground_truth"):
        FunctionReward("needs_label", needs_label)(make_batch(["a"], ground_truth=["x"]))


def test_dict_results_log_their_extra_keys():
    def fn(prompt, response):
        return {"score": 1.0, "acc": 1.0 if response == "a" else 0.0, "note": "text is ignored"}

    res = FunctionReward("withinfo", fn)(make_batch(["a", "b"]))
    assert res.scores == [1.0, 1.0] and res.metrics == {"reward/withinfo/acc": 0.5}


@pytest.mark.parametrize("value, match", [
    ("0.5", "string"), ([1.0, 2.0], "not a number"), ({"acc": 1}, "without a 'score' key")])
def test_non_numeric_results_are_rejected(value, match):
    def fn(prompt, response):
        return value

    with pytest.raises(RewardError, match=match):
        FunctionReward("bad", fn)(make_batch(["a"]))


def test_batched_result_of_wrong_length_or_kind():
    with pytest.raises(RewardError, match="returned 1 scores for 2 samples"):
        FunctionReward("short", lambda prompts, responses: [1.0])(make_batch(["a", "b"]))
    with pytest.raises(RewardError, match="per_sample = True"):
        FunctionReward("scalar", lambda prompts, responses: 1.0)(make_batch(["a", "b"]))


# -- bad input ----------------------------------------------------------------------------------


def raise_on_boom(prompt, response):
    if "boom" in response:
        raise ValueError("cannot parse")
    return 1.0


def test_a_raising_sample_fails_the_step_showing_it():
    batch = make_batch(["fine", "it went boom here"], ground_truth=["g0", "g1"])
    with pytest.raises(RewardError) as err:
        FunctionReward("parse", raise_on_boom)(batch)
    text = str(err.value)
    assert "failed on sample 1: ValueError: cannot parse" in text
    assert "'it went boom here'" in text and "ground_truth: 'g1'" in text and "fallback_score" in text


def test_fallback_score_replaces_failures_and_counts_them():
    res = FunctionReward("parse", raise_on_boom, fallback=-1.0)(make_batch(["boom", "ok", "boom"]))
    assert res.scores == [-1.0, 1.0, -1.0] and res.errors == 2


def test_batched_failure_is_traced_to_its_sample():
    def batched(prompts, responses):
        return [float(len(r)) if "boom" not in r else 1 / 0 for r in responses]

    batch = make_batch(["a", "bb", "boom"])
    with pytest.raises(RewardError, match="failed on sample 2: ZeroDivisionError"):
        FunctionReward("b", batched)(batch)
    assert FunctionReward("b", batched, fallback=0.0)(batch).scores == [1.0, 2.0, 0.0]


def test_batched_failure_of_the_batch_only():
    def picky(prompts, responses):
        if len(responses) > 1:
            raise RuntimeError("needs a single sample")
        return [1.0]

    with pytest.raises(RewardError, match="on none of them alone: RuntimeError"):
        FunctionReward("picky", picky, fallback=0.0)(make_batch(["a", "b"]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("batched", [False, True])
def test_non_finite_scores_name_the_sample(bad, batched):
    if batched:
        def fn(prompts, responses):
            return [bad if r == "x" else 0.0 for r in responses]
    else:
        def fn(prompt, response):
            return bad if response == "x" else 0.0

    with pytest.raises(RewardError, match=r"(?s)gave (nan|inf|-inf) for sample 1.*response: 'x'") as err:
        FunctionReward("nf", fn, fallback=0.0)(make_batch(["ok", "x"]))
    assert "prompt: 'q1'" in str(err.value)


def test_reward_errors_from_the_function_are_not_swallowed():
    from rlcore.rewards.rules import exact_match

    with pytest.raises(RewardError, match="needs a 'ground_truth' column"):
        FunctionReward("exact_match", exact_match, fallback=0.0)(make_batch(["a"]))


# -- worker pool --------------------------------------------------------------------------------

POOL_FN = """
import time

def compute_score(prompt, response, ground_truth=None):
    if response == "slow":
        time.sleep(60)
    if response == "boom":
        raise KeyError("no key")
    return float(len(response))

def batched(prompts, responses):
    return [float(len(r)) for r in responses]
"""


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, timeout_s=1.5)
    yield p
    p.close()


def test_pool_matches_in_process_scores(tmp_path, pool):
    path = write(tmp_path, POOL_FN)
    batch = make_batch(["a", "bb", "ccc", "dddd", "e"])
    for name in ("compute_score", "batched"):
        fn = load_function(path, name)
        local = FunctionReward(name, fn)(batch).scores
        remote = FunctionReward(name, fn, pool=pool, ref=("load", path, name))(batch).scores
        assert remote == local == [1.0, 2.0, 3.0, 4.0, 1.0]


def test_pool_timeout_and_errors(tmp_path, pool):
    path = write(tmp_path, POOL_FN)
    ref = ("load", path, "compute_score")
    fn = load_function(path, "compute_score")
    batch = make_batch(["a", "slow", "boom", "dd"])
    res = FunctionReward("c", fn, pool=pool, ref=ref, fallback=-5.0)(batch)
    assert res.scores == [1.0, -5.0, -5.0, 2.0]
    assert (res.errors, res.timeouts) == (2, 1)
    assert pool.restarts >= 1  # the hung worker was replaced
    with pytest.raises(RewardError, match=r"sample 1: no result within reward.timeout_s=1.5 s"):
        FunctionReward("c", fn, pool=pool, ref=ref)(make_batch(["a", "slow"]))
    with pytest.raises(RewardError, match=r"(?s)sample 0: KeyError: 'no key'.*worker traceback"):
        FunctionReward("c", fn, pool=pool, ref=ref)(make_batch(["boom"]))
    # the pool still works afterwards
    assert FunctionReward("c", fn, pool=pool, ref=ref)(make_batch(["abc"])).scores == [3.0]


def test_pool_needs_a_picklable_function(pool):
    with pytest.raises(RewardError, match="cannot be pickled"):
        FunctionReward("lam", lambda prompt, response: 0.0, pool=pool)
