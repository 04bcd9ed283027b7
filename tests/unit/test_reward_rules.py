"""Built-in reward rules and their answer extraction."""

from __future__ import annotations

import pytest

from rlcore.errors import RewardError
from rlcore.rewards import rules
from rlcore.rewards.rules import (BUILTIN_REWARDS, answers_equal, exact_match, extract_boxed, extract_final_answer,
                                  extract_gsm8k, format_penalty, gsm8k, length_penalty, math_equiv, parse_number)


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,234", 1234.0), ("$1,234.50", 1234.5), ("3/4", 0.75),
    ("\\frac{3}{4}", 0.75), ("\\dfrac{-1}{2}", -0.5), ("-\\dfrac{1}{2}", -0.5), ("50%", 50.0), ("7.", 7.0), ("1e3", 1000.0),
    ("12 \\text{ cm}", 12.0), (".5", 0.5), (3, 3.0),
])
def test_parse_number(text, value):
    assert parse_number(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "x+1", "1,2", "", None, True, "1/0"])
def test_parse_number_rejects_non_numbers(text):
    assert parse_number(text) is None


def test_extractors():
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and then \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed("no box") is None
    assert extract_gsm8k("work\n#### 1,234.\n") == "1,234"
    assert extract_gsm8k("#### 1\nmore\n#### 2") == "2"
    assert extract_gsm8k("no marker 5") is None
    assert extract_final_answer("We get 3 then \\boxed{7}") == "7"
    assert extract_final_answer("So the answer is 12.") == "12"
    assert extract_final_answer("first 3, then 9 apples") == "9"
    assert extract_final_answer("nothing numeric") is None


def test_answers_equal():
    assert answers_equal("0.5", "\\frac{1}{2}")
    assert answers_equal("1,000", "1000")
    assert not answers_equal("0.5", "0.51")
    assert answers_equal("\\sqrt{2}", "$\\sqrt{2}$")
    assert not answers_equal(None, "1")


def test_exact_match_normalises_and_accepts_lists():
    out = exact_match(["p"] * 4, ["  Paris. ", "paris", "Lyon", "B"], ground_truth=["paris", "PARIS", "paris", ["a", "b"]])
    assert out == [1.0, 1.0, 0.0, 1.0]


def test_gsm8k_is_strict_about_the_marker():
    responses = ["3 + 4 = 7\n#### 7", "The answer is 7", "#### 8", "#### 1,000"]
    truths = ["Natalia sold 3+4 = 7 clips.\n#### 7", "7", "7", "1000"]
    assert gsm8k([""] * 4, responses, ground_truth=truths) == [1.0, 0.0, 0.0, 1.0]


def test_math_equiv_numeric_equivalence():
    responses = ["thus \\boxed{\\frac{1}{2}}", "The answer is 0.5", "#### 2/4", "\\boxed{0.49}", "result: 3"]
    truths = ["0.5", "\\frac{1}{2}", "0.5", "0.5", "The total is \\boxed{3}"]
    assert math_equiv([""] * 5, responses, ground_truth=truths) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_rules_need_ground_truth():
    with pytest.raises(RewardError, match="ground_truth"):
        exact_match(["p"], ["r"])
    with pytest.raises(RewardError, match="2 ground_truth values for 1"):
        gsm8k(["p"], ["r"], ground_truth=["1", "2"])


def test_format_penalty():
    responses = ["#### 4", "\\boxed{4}", "<answer>4</answer>", "4", "", "<think>hmm #### 4", "<think>a</think> #### 4"]
    assert format_penalty([""] * 7, responses) == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, 0.0]
    assert format_penalty(["", ""], ["yes", "no"], format_pattern=["^yes$", "^yes$"]) == [0.0, -1.0]


def test_length_penalty_ramps_to_minus_one():
    limit = 100  # the ramp is min(LENGTH_PENALTY_BUFFER, limit // 2) = 50 tokens
    ids = [[0] * n for n in (10, 50, 60, 80, 100, 150)]
    out = length_penalty([""] * 6, [""] * 6, response_ids=ids, max_response_length=[limit] * 6)
    assert out == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    # without ids the words are counted; without a column the default limit applies
    assert length_penalty([""], ["a b c"]) == [0.0]
    assert rules.overlong_penalty(rules.LENGTH_PENALTY_MAX, rules.LENGTH_PENALTY_MAX, rules.LENGTH_PENALTY_BUFFER) == -1


def test_builtin_table_and_demo_rule():
    import rlcore.demo

    base = {"exact_match", "gsm8k", "math_equiv", "format_penalty", "length_penalty", "env_reward"}
    demo = set(BUILTIN_REWARDS) - base
    assert base <= set(BUILTIN_REWARDS) and demo and demo <= set(rules.DEMO_RULES)
    for name in demo:  # the registered rule is the demo module's own function
        assert BUILTIN_REWARDS[name] is getattr(rlcore.demo, rules.DEMO_RULES[name])
    # the lazy form calls through to the same function
    name = sorted(demo)[0]
    lazy = rules._lazy_demo_rule(rules.DEMO_RULES[name])
    assert lazy(["a b c"], ["c d e f"]) == BUILTIN_REWARDS[name](["a b c"], ["c d e f"])


def test_defaults_plugin_registers_the_builtin_rules(rlcore_pm):
    found = {}
    rlcore_pm.hook.rlcore_register_rewards(register=lambda name, fn: found.__setitem__(name, fn))
    assert {k: found[k] for k in BUILTIN_REWARDS} == BUILTIN_REWARDS


def test_env_reward_reads_the_episode_reward():
    assert BUILTIN_REWARDS["env_reward"](["p", "q", "r"], ["a", "b", "c"], env_reward=[1.0, None, 0.25]) == [1.0, 0.0,
                                                                                                          0.25]
