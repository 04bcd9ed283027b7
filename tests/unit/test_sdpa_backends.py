"""trainer.sdpa_backends: checked when the config loads, applied on CUDA only, put back when the run ends."""

import pytest
import torch

from rlcore.config import load_config
from rlcore.config.loader import ConfigError
from rlcore.trainer import sdpa


@pytest.fixture
def switches_kept():
    before = {name: getattr(torch.backends.cuda, get)() for name, (get, _) in sdpa.SWITCHES.items()}
    yield before
    for name, on in before.items():
        getattr(torch.backends.cuda, sdpa.SWITCHES[name][1])(on)


def state():
    return {name: getattr(torch.backends.cuda, get)() for name, (get, _) in sdpa.SWITCHES.items()}


@pytest.mark.parametrize("value, words", [("[flash,bogus]", "'bogus'"), ("[]", "non-empty"), ("flash", "list")])
def test_a_bad_value_names_the_key(value, words):
    with pytest.raises(ConfigError) as err:
        load_config([], [f"trainer.sdpa_backends={value}"])
    assert "trainer.sdpa_backends" in str(err.value) and words in str(err.value)


def test_only_the_named_kernels_stay_on_and_close_puts_back_the_switches(switches_kept):
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.enable_flash_sdp(False)
    found = state()
    switches = sdpa.apply(["flash", "math"], torch.device("cuda"))
    assert state() == {"flash": True, "efficient": False, "cudnn": False, "math": True}
    switches.close()
    assert state() == found
    switches.close()  # once
    assert state() == found


def test_nothing_changes_off_cuda_or_when_null(switches_kept):
    found = state()
    assert sdpa.apply(["flash"], torch.device("cpu")) is None
    assert sdpa.apply(None, torch.device("cuda")) is None
    assert state() == found


def test_a_run_sets_the_switches_while_it_runs_and_puts_them_back_at_its_end(tmp_path, monkeypatch, switches_kept):
    """The switches are part of the run's built answers: on (here forced, as on CUDA) from the build to
    the end of the run, whatever they were before, and back afterwards."""
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.protocols import DistInfo
    from rlcore.testing import demo_overrides
    from rlcore.trainer.loop import Trainer

    monkeypatch.setattr(sdpa, "apply", lambda names, device: sdpa.SdpaSwitches(names) if names else None)
    torch.backends.cuda.enable_cudnn_sdp(True)
    found = state()
    cfg = load_config([], [*demo_overrides(tmp_path), "trainer.progress=false", "trainer.gpu_monitor=false",
                           "trainer.export_final=false", "plugins=[]", "trainer.max_steps=1",
                           "trainer.sdpa_backends=[flash,math]"])
    trainer = Trainer(cfg, build_plugin_manager([]), DistInfo())
    assert state() == {"flash": True, "efficient": False, "cudnn": False, "math": True}
    trainer.train()
    assert state() == found
