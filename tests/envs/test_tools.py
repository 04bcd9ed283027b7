"""Tool-call parsing and the tool environment: malformed calls are observations and metrics, not crashes."""

import asyncio

import pytest

from rlcore.envs import Step, ToolCall, ToolCallError, Turn, parse_hermes
from rlcore.envs.builtin import GuessEnv, PythonToolEnv, answers_match


def test_hermes_parser_reads_calls_and_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("python", {"code": "print(1)"})]
    assert parsed.content == "Let me compute."
    # arguments given as a JSON string, and an unclosed last call
    parsed = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}')
    assert parsed.calls == [ToolCall("f", {"x": 2})]


@pytest.mark.parametrize("body, reason", [("{not json}", "not valid JSON"), ('["a"]', "JSON object"),
                                          ('{"arguments": {}}', '"name"'),
                                          ('{"name": "f", "arguments": 3}', '"arguments"')])
def test_malformed_calls_become_errors(body, reason):
    parsed = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert len(parsed.errors) == 1 and isinstance(parsed.calls[0], ToolCallError)
    assert reason in parsed.calls[0].reason


def step(env, text, index=0):
    return asyncio.run(env.step(Turn(text=text, token_ids=(), index=index)))


def test_python_tool_environment_runs_code_and_scores_the_answer():
    env = PythonToolEnv({"timeout_s": 3.0, "sandbox": "best-effort"})  # any host: what the tool does
    env.start({"ground_truth": "42"})
    out = step(env, '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    assert not out.done and out.observation == [{"role": "tool", "content": "42"}]
    assert out.metrics["tool_calls"] == 1 and out.metrics["tool_errors"] == 0
    final = step(env, "The answer is 42.", 1)
    assert final.done and final.reward == 1.0
    assert step(env, "It is 41", 1).reward == 0.0


def test_tool_errors_are_observations_and_metrics():
    env = PythonToolEnv({"timeout_s": 1.0, "cpu_s": 1, "sandbox": "best-effort"})
    env.start({"ground_truth": "1"})
    out = step(env, "<tool_call>{broken</tool_call>")
    assert "malformed tool call" in out.observation[0]["content"]
    assert out.metrics["tool_errors"] == 1 and out.metrics["malformed_calls"] == 1
    out = step(env, '<tool_call>{"name": "shell", "arguments": {}}</tool_call>')
    assert "unknown tool" in out.observation[0]["content"] and out.metrics["tool_errors"] == 1
    out = step(env, '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>')
    assert out.metrics["tool_timeouts"] == 1 and out.metrics["tool_errors"] == 1


def test_environment_settings_are_checked():
    with pytest.raises(ValueError, match="plugin_config.python.timeout"):
        PythonToolEnv({"timeout": 3})
    with pytest.raises(ValueError, match="plugin_config.guess.low"):
        GuessEnv({"low": 5, "high": 1})


def test_guessing_game_gives_feedback():
    env = GuessEnv({"low": 1, "high": 10})
    env.start({"secret": 7})
    assert env.step(Turn("5", (), 0)).observation == "higher"
    assert env.step(Turn("I say 9", (), 1)).observation == "lower"
    assert env.step(Turn("no idea", (), 2)).metrics == {"invalid_guesses": 1.0}
    last = env.step(Turn("7", (), 3))
    assert isinstance(last, Step) and last.done and last.reward == 1.0


def test_answers_match_numbers_and_text():
    assert answers_match("so it is 1,234.0", "1234") and not answers_match("12", "1234")
    assert answers_match(" Paris ", "paris")
