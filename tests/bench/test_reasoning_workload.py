"""The reasoning benchmark's stop rule: the number of stop tokens for a target mean length."""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

from bench_reasoning import (  # noqa: E402
    capped_mean, geometric_lengths, length_stats, make_prompts, stop_count, stop_ids)


def test_stop_count_gives_the_target_mean_under_the_cap():
    k = stop_count(151936, 1500, 8192)
    assert 95 <= k <= 110  # about V / 1500
    assert abs(capped_mean(k / 151936, 8192) - 1500) < 20
    assert capped_mean(k / 151936, 8192) <= 8192
    assert stop_count(512, 12, 32) >= 1


def test_sampled_geometric_lengths_match_the_formula():
    """Drawing each step's stop with probability k / V gives the mean the rule was sized for."""
    vocab, cap = 4096, 256
    k = stop_count(vocab, 60, cap)
    rng = random.Random(0)
    lengths = []
    for _ in range(4000):
        length = 1
        while length < cap and rng.random() >= k / vocab:
            length += 1
        lengths.append(length)
    stats = length_stats(lengths, cap)
    assert abs(stats["mean"] - capped_mean(k / vocab, cap)) < 3
    assert stats["p90"] > 2 * stats["p50"] - 10  # a long tail


def test_prompts_avoid_the_stop_ids_and_span_the_lengths():
    stops = stop_ids(1000, 20)
    assert stops[0] == 0 and len(set(stops)) == 20
    prompts = make_prompts(200, 64, 512, 1000, stops)
    assert all(64 <= len(p) <= 512 for p in prompts)
    assert not set(stops) & {t for p in prompts for t in p}
    assert min(map(len, prompts)) < 100 and max(map(len, prompts)) > 470


def test_fixed_lengths_are_the_stop_rules_distribution_drawn_the_same_every_run():
    """--fixed-lengths: the same stream gives the same lengths; the lengths follow the capped geometric
    distribution the stop rule would give (its mean, its cap)."""
    vocab, cap = 4096, 256
    p = stop_count(vocab, 60, cap) / vocab
    lengths = geometric_lengths(4000, p, cap, "fixed-1")
    assert lengths == geometric_lengths(4000, p, cap, "fixed-1")
    assert lengths != geometric_lengths(4000, p, cap, "fixed-2")
    assert min(lengths) >= 1 and max(lengths) == cap
    assert abs(sum(lengths) / len(lengths) - capped_mean(p, cap)) < 3


def test_the_table_notes_a_step_whose_timed_parts_miss_much_of_it(capsys):
    """A step with seconds outside every timed part (``parts.other``) gets a note under the table: the
    parts' figures, the update's MFU among them, would leave that work out."""
    from bench_reasoning import UNTIMED_WARN, print_table

    def row(other):
        parts = {"rollout": 27.5, "scoring": 0.1, "logprobs": 0.0, "update": 9.4, "other": other}
        return {"shape": "qwen2.5-1.5b", "system": "rlcore", "step_s": 37.0 + other, "parts": parts,
                "lengths": {"mean": 1500, "p90": 3300, "max": 8192}, "tokens_per_s": 1.0, "samples_per_s": 6.3,
                "update_mfu": 0.5, "gpu": {}, "setting": {}}

    print_table({"results": [row(3.4)]})
    assert "3.40 s of the 40.40 s step are in no timed part" in capsys.readouterr().out
    print_table({"results": [row(UNTIMED_WARN * 37.0 * 0.5)]})
    assert "no timed part" not in capsys.readouterr().out
