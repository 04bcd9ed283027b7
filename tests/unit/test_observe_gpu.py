"""GPU monitor: summary math, background sampling with a fake NVML reader, clean behaviour without a GPU."""

from __future__ import annotations

import time

import pytest

from rlcore.observe import gpu
from rlcore.observe.gpu import GPUMonitor, Sample, longest_run_below, percentile, run_monitor, summarize


def test_percentile_and_dips():
    assert percentile([5.0], 10) == 5.0
    assert percentile(list(range(11)), 10) == pytest.approx(1.0)
    assert percentile([0, 100], 50) == pytest.approx(50.0)
    assert longest_run_below([90, 60, 50, 90, 65, 90], 70) == 2
    assert longest_run_below([], 70) == 0


def test_summary_applies_the_seed_health_rule():
    steady = summarize([90.0] * 20, [10.0] * 20, 0.5)
    assert steady["gpu/util_mean"] == 90.0 and steady["gpu/healthy"] == 1.0
    dips = summarize([95.0] * 16 + [20.0] * 4, [1.0] * 20, 0.5)  # mean 80, p10 under 70
    assert dips["gpu/healthy"] == 0.0 and dips["gpu/longest_dip_s"] == 2.0
    assert dips["gpu/dip_frac"] == pytest.approx(0.2) and dips["gpu/util_p10"] < 70
    assert summarize([], [], 0.5) == {}


class FakeReader:
    names = ["Fake GPU"]

    def __init__(self, utils):
        self.utils = list(utils)
        self.closed = False

    def read(self):
        u = self.utils.pop(0) if len(self.utils) > 1 else self.utils[0]
        return [Sample(u, 40.0 + u / 100, 80.0)]

    def close(self):
        self.closed = True


def test_monitor_samples_in_background_and_summarises_windows():
    reader = FakeReader([90.0] * 3 + [50.0] * 1000)
    mon = GPUMonitor(0.01, reader_factory=lambda: reader)
    mon.start()
    assert mon.available
    deadline = time.monotonic() + 10
    while mon.summary().get("gpu/samples", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    first = mon.interval_summary()
    second_wait = time.monotonic() + 10
    while not mon.interval_summary() and time.monotonic() < second_wait:
        time.sleep(0.01)
    mon.stop()
    assert reader.closed
    whole = mon.summary()
    assert whole["gpu/samples"] >= 6 and whole["gpu/mem_used_gb_max"] == pytest.approx(40.9)
    assert first["gpu/util_mean"] > whole["gpu/util_mean"] - 1e-9  # the early window holds the 90% samples
    assert whole["gpu/healthy"] == 0.0


def test_disabled_or_without_nvml_is_empty(monkeypatch):
    off = GPUMonitor(0)
    off.start()
    off.stop()
    assert not off.available and off.summary() == {} and off.interval_summary() == {}
    monkeypatch.setattr(gpu, "open_reader", lambda devices=None: (None, "no NVML here"))
    mon = GPUMonitor(0.1)
    mon.start()
    mon.stop()
    assert not mon.available and mon.reason == "no NVML here" and mon.summary() == {}


def test_without_nvml_the_plugin_says_so_once_and_does_not_retry_each_step(monkeypatch, caplog):
    from rlcore.plugins.gpu_monitor import GPUMonitorPlugin

    opened = []
    monkeypatch.setattr(gpu, "open_reader", lambda devices=None: opened.append(devices) or (None, "no NVML here"))
    plugin = GPUMonitorPlugin()
    plugin.rlcore_train_start(config={"trainer": {"max_steps": 6, "log_steps": 2}})
    with caplog.at_level("INFO", logger="rlcore.observe.gpu"):
        for step in range(1, 7):
            plugin.rlcore_step_start(step=step)
            plugin.rlcore_step_end(step=step, metrics={})
        summary: dict = {}
        plugin.rlcore_train_end(summary=summary)
    assert len(opened) == 1 and summary == {}
    assert [r.getMessage() for r in caplog.records] == ["GPU monitor off: no NVML here"]


def test_run_monitor_prints_samples_and_a_verdict(monkeypatch):
    lines = []
    assert run_monitor(0.001, 3, lines.append, reader=FakeReader([92.0, 88.0, 90.0])) == 0
    assert lines[0] == "watching gpu0=Fake GPU" and len(lines) == 5
    assert "gpu0  92%" in lines[1] and lines[-1].endswith("-> healthy")
    monkeypatch.setattr(gpu, "open_reader", lambda devices=None: (None, "NVML is not usable here (x)"))
    lines.clear()
    assert run_monitor(0.01, 2, lines.append) == 0
    assert lines == ["no GPU to monitor: NVML is not usable here (x)"]


def test_readings_are_summarised_per_phase_with_the_rollout_tail_apart():
    reader = FakeReader([90.0])
    mon = GPUMonitor(0.5, reader_factory=lambda: reader)
    mon._reader = reader  # sampled by hand below, no thread
    mon.set_phase("generate")
    for u in [95.0] * 6 + [20.0] * 2:  # the rollout's last quarter nearly idle
        reader.utils = [u]
        mon.sample_once()
    mon.set_phase("train")
    for u in (60.0, 80.0):
        reader.utils = [u]
        mon.sample_once()
    out = mon.summary()
    assert out["gpu/util_mean_generate"] == pytest.approx((6 * 95 + 2 * 20) / 8)
    assert out["gpu/util_mean_generate_tail"] == pytest.approx(20.0)
    assert out["gpu/util_mean_train"] == pytest.approx(70.0)
    assert out["gpu/util_p10_train"] == pytest.approx(62.0)
    assert out["gpu/samples"] == 10


def _sample(mon: GPUMonitor, reader: FakeReader, utils) -> None:
    for u in utils:
        reader.utils = [u]
        mon.sample_once()


def test_readings_outside_steps_stay_out_of_the_step_health_summary():
    reader = FakeReader([90.0])
    mon = GPUMonitor(0.5, reader_factory=lambda: reader)
    mon._reader = reader  # sampled by hand below, no thread
    _sample(mon, reader, [95.0] * 10)  # step 1
    mon.interval_summary()
    mon.set_phase(gpu.OUTSIDE)  # a CUDA graph capture before the measured step: 9.5 s near idle
    _sample(mon, reader, [0.0] * 19)
    mon.set_phase(gpu.TRAIN)
    _sample(mon, reader, [95.0] * 10)  # step 2, the measured one
    out = mon.interval_summary()
    assert out["gpu/util_p10"] == pytest.approx(95.0) and out["gpu/util_mean"] == pytest.approx(95.0)
    assert out["gpu/util_min"] == 95.0 and out["gpu/dip_frac"] == 0.0 and out["gpu/longest_dip_s"] == 0.0
    assert out["gpu/healthy"] == 1.0 and out["gpu/samples"] == 10
    assert out["gpu/util_p10_train"] == pytest.approx(95.0)
    assert out["gpu/util_mean_outside"] == 0.0 and out["gpu/outside_s"] == pytest.approx(9.5)
    assert "gpu/util_p10_outside" not in out
    assert out["gpu/mem_used_gb_max"] == pytest.approx(40.95)  # memory keeps every reading
    whole = mon.summary()
    assert whole["gpu/util_p10"] == pytest.approx(95.0) and whole["gpu/samples"] == 20
    assert whole["gpu/outside_s"] == pytest.approx(9.5)


def test_a_dip_does_not_join_across_readings_outside_steps():
    reader = FakeReader([90.0])
    mon = GPUMonitor(0.5, reader_factory=lambda: reader)
    mon._reader = reader
    _sample(mon, reader, [95.0, 20.0, 20.0])  # a step ending low
    mon.set_phase(gpu.OUTSIDE)
    _sample(mon, reader, [10.0] * 4)
    mon.set_phase(gpu.TRAIN)
    _sample(mon, reader, [30.0, 95.0])  # the next step starting low
    out = mon.summary()
    assert out["gpu/longest_dip_s"] == pytest.approx(1.0)  # 2 readings, not 3, let alone 7
    assert out["gpu/outside_s"] == pytest.approx(2.0)
    assert longest_run_below([20, 20, 10, 30], 70, [False, False, True, False]) == 2


def test_only_readings_outside_steps_leave_out_the_health_keys():
    reader = FakeReader([5.0])
    mon = GPUMonitor(0.5, reader_factory=lambda: reader, phase=gpu.OUTSIDE)
    mon._reader = reader
    _sample(mon, reader, [5.0, 15.0])
    out = mon.interval_summary()
    assert out == {"gpu/mem_used_gb_max": pytest.approx(40.15), "gpu/util_mean_outside": pytest.approx(10.0),
                   "gpu/outside_s": pytest.approx(1.0)}
    assert summarize([5.0], [1.0], 0.5, [gpu.OUTSIDE]) == {"gpu/mem_used_gb_max": 1.0}
    with pytest.raises(ValueError):
        summarize([5.0, 6.0], [1.0, 1.0], 0.5, [gpu.TRAIN])


def test_the_plugin_tags_readings_between_steps_outside(monkeypatch):
    from rlcore.plugins.gpu_monitor import GPUMonitorPlugin

    reader = FakeReader([0.0])
    monkeypatch.setattr(gpu, "open_reader", lambda devices=None: (reader, ""))
    monkeypatch.setattr(GPUMonitor, "_loop", lambda self: None)  # no thread sampling: by hand below
    plugin = GPUMonitorPlugin()
    plugin.rlcore_train_start(config={"trainer": {"max_steps": 3, "log_steps": 1}})
    mon = plugin.monitor
    assert mon.phase == gpu.OUTSIDE  # before the first step
    steps = []
    for step in range(1, 4):
        plugin.rlcore_step_start(step=step)
        assert mon.phase == gpu.TRAIN
        plugin.rlcore_before_generation(step=step)
        _sample(mon, reader, [90.0] * 4)
        plugin.rlcore_after_generation(step=step)
        assert mon.phase == gpu.TRAIN
        _sample(mon, reader, [96.0] * 4)
        metrics: dict = {}
        plugin.rlcore_step_end(step=step, metrics=metrics)
        steps.append(metrics)
        assert mon.phase == gpu.OUTSIDE
        _sample(mon, reader, [0.0] * 6)  # evaluation, a checkpoint save: after rlcore_step_end
    assert mon._phases[-6:] == [gpu.OUTSIDE] * 6
    assert mon._phases[:8] == [gpu.GENERATE] * 4 + [gpu.TRAIN] * 4
    second = steps[1]
    assert second["gpu/util_p10"] == pytest.approx(90.0) and second["gpu/util_min"] == 90.0
    assert second["gpu/longest_dip_s"] == 0.0 and second["gpu/healthy"] == 1.0
    assert second["gpu/util_p10_train"] == pytest.approx(96.0) and second["gpu/outside_s"] == pytest.approx(3.0)
    assert steps[0]["gpu/outside_s"] == 0.0
    summary: dict = {}
    plugin.rlcore_train_end(summary=summary)
    assert summary["gpu/util_min"] == 90.0 and summary["gpu/samples"] == 24
