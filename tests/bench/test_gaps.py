"""The idle-gap report of the benchmarks (bench/_gaps.py): busy share, gaps and what the host did in them."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import _gaps  # noqa: E402


def test_merge_joins_overlapping_and_touching_intervals():
    assert _gaps.merge([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]


def test_idle_report_counts_gaps_and_puts_each_on_the_innermost_host_op():
    busy = [(0, 100), (90, 200), (700, 800), (850, 1000)]  # idle: 200-700 (500 us), 800-850 (50 us)
    ops = [(0, 1000, "rlcore.update.micro_batch"), (150, 650, "aten::item"), (160, 640, "cudaStreamSynchronize"),
           (790, 900, "aten::copy_")]
    report = _gaps.idle_report(busy, ops, (0, 1000), min_gap_us=100)
    assert report["busy_s"] == pytest.approx(450e-6) and report["idle_s"] == pytest.approx(550e-6)
    assert report["busy_frac"] == pytest.approx(0.45)
    gap, = report["longest_gaps"]
    assert gap["ms"] == pytest.approx(0.5) and gap["at_ms"] == pytest.approx(0.2)
    assert gap["during"] == "rlcore.update.micro_batch > aten::item > cudaStreamSynchronize"
    assert report["idle_by_op"] == [{"op": "cudaStreamSynchronize", "gaps": 1, "s": pytest.approx(500e-6)}]
    assert report["short_gaps"] == {"count": 1, "s": pytest.approx(50e-6)}


def test_idle_report_clips_to_the_window_and_counts_its_edges():
    busy = [(-50, 30), (60, 80), (95, 300)]  # window 0-100: busy 0-30, 60-80, 95-100
    report = _gaps.idle_report(busy, [(-10, 200, "outer")], (0, 100), min_gap_us=10)
    assert report["busy_s"] == pytest.approx(55e-6) and report["idle_s"] == pytest.approx(45e-6)
    assert [g["ms"] for g in report["longest_gaps"]] == [pytest.approx(0.030), pytest.approx(0.015)]
    assert report["idle_by_op"][0] == {"op": "outer", "gaps": 2, "s": pytest.approx(45e-6)}


def test_a_gap_without_a_host_op_is_named_so_and_an_empty_window_is_refused():
    report = _gaps.idle_report([], [], (0, 400), min_gap_us=1)
    assert report["busy_frac"] == 0 and report["longest_gaps"][0]["during"] == "(no host op)"
    with pytest.raises(ValueError, match="empty window"):
        _gaps.idle_report([], [], (5, 5))
    assert "device busy" in _gaps.format_report(report)
