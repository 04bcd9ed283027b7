"""``rlcore eval``: pass@k (the unbiased estimator), the report, and the same numbers as the trainer's own
evaluation of the same policy on the same rows."""

from __future__ import annotations

import json
import math

import pytest

from rlcore.cli import main
from rlcore.trainer.evaluation import PromptResult, pass_at_k, summarize, val_metrics


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    for n, c, k in [(16, 3, 1), (16, 3, 5), (10, 7, 2), (5, 1, 3)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_summary_per_data_source():
    results = [PromptResult("gsm8k", [1.0, 0.0], [3, 5], [False, True]),
               PromptResult("gsm8k", [0.0, 0.0], [2, 2], [False, False]),
               PromptResult("math", [1.0, 1.0], [4, 6], [False, False])]
    s = summarize(results, 2, 1.0)
    assert s["all"]["prompts"] == 3 and s["all"]["samples"] == 6 and s["all"]["reward_mean"] == pytest.approx(0.5)
    assert s["all"]["pass"] == {"1": pytest.approx(0.5), "2": pytest.approx(2 / 3)}
    assert s["by_source"]["gsm8k"]["pass"]["2"] == 0.5 and s["by_source"]["math"]["pass"]["1"] == 1.0
    assert s["all"]["length_max"] == 6 and s["all"]["clip_frac"] == pytest.approx(1 / 6)
    flat = val_metrics(s)
    assert flat["reward_mean"] == pytest.approx(0.5) and flat["pass@2"] == pytest.approx(2 / 3)
    assert flat["math/pass@1"] == 1.0 and flat["response_length"] == pytest.approx(22 / 6)


def _val_after(run_dir) -> dict:
    """The trainer's last evaluation, as ``metrics.jsonl`` recorded it."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split") == "val"][-1]


@pytest.mark.slow
def test_eval_on_the_demo_agrees_with_the_trainers_evaluation(tmp_path, monkeypatch, capsys):
    """``rlcore train`` then ``rlcore eval`` (the demo's final policy): the same mean reward, pass@k and
    lengths as the trainer's final evaluation, greedy and sampled; and the same from a checkpoint."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "demo"
    sampled = ["eval.n=4", "eval.temperature=0.6", "eval.pass_threshold=0.5"]
    common = ["trainer.eval_samples=16", "trainer.progress=false"]
    assert main(["train", "trainer.max_steps=2", *common, *sampled]) == 0
    val = _val_after(run)
    assert main(["eval", *common, *sampled]) == 0
    out = capsys.readouterr().out
    report = json.loads((run / "eval.json").read_text())
    assert report["model"] == "runs/demo/final" and report["all"]["prompts"] == 16
    assert report["all"]["samples"] == 64 and set(report["all"]["pass"]) == {"1", "2", "3", "4"}
    assert report["all"]["reward_mean"] == pytest.approx(val["reward_mean"], abs=1e-9)
    for k in range(1, 5):
        assert report["all"]["pass"][str(k)] == pytest.approx(val[f"pass@{k}"], abs=1e-9)
    assert report["all"]["length_mean"] == pytest.approx(val["response_length"], abs=1e-9)
    passes = [report["all"]["pass"][str(k)] for k in range(1, 5)]
    assert passes == sorted(passes)  # pass@k never falls with k
    assert "demo_alphabet" in out and "pass@4" in out and "runs/demo/eval.json" in out

    greedy = tmp_path / "greedy.json"  # a checkpoint of the same policy, greedy: the trainer's default evaluation
    assert main(["eval", "actor.model_path=runs/demo/checkpoints", *common, f"eval.output={greedy}"]) == 0
    report = json.loads(greedy.read_text())
    assert report["model"].endswith("step_00000002") and report["eval"]["n"] == 1
    assert report["eval"]["temperature"] == 0.0 and report["all"]["samples"] == 16


def test_eval_names_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval"]) == 2
    assert "no trained demo policy in runs/demo/final: run `rlcore train` first" in capsys.readouterr().err
    assert main(["eval", "actor.model_path=nowhere"]) == 2
    assert "'actor.model_path' = 'nowhere': no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", "actor.model_path=empty"]) == 2
    assert "neither a Hugging Face model directory" in capsys.readouterr().err
    assert main(["eval", "eval.n=0"]) == 2
    assert "'eval.n' must be >= 1" in capsys.readouterr().err
