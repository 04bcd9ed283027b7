"""The update reports what torch.compile compiled inside it (recompiles leave the device idle)."""

import torch

from rlcore.observe.compile_stats import reading


def test_a_compilation_between_two_readings_is_counted_with_its_time():
    fn = torch.compile(lambda x: x * 3 - 1, dynamic=False)
    before = reading()
    fn(torch.randn(5))
    after = reading()
    fn(torch.randn(5))  # cached: nothing more to compile
    delta, again = after.since(before, "update"), reading().since(after, "update")
    assert delta["update/compiled_frames"] >= 1 and delta["time/update_compile_s"] > 0
    assert again == {"update/compiled_frames": 0.0, "time/update_compile_s": 0.0}
