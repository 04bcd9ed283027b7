"""What rlcore promises a plugin across releases and checks of its answers (docs/plugins.md,
"What rlcore checks of a plugin's answers" and "Plugin API versions")."""

from __future__ import annotations

import os
import sys

import pytest

import rlcore
from rlcore.config import load_config
from rlcore.demo import DEMO_OVERRIDES
from rlcore.plugin_manager import BUILTIN_MODULES, build_plugin_manager
from rlcore.protocols import DistInfo

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

#: the demo, as small as a run gets
SMALL = ("trainer.max_steps=1", "trainer.progress=false", "trainer.gpu_monitor=false", "trainer.export_final=false",
         "trainer.eval_samples=4", "ppo.rollout_batch_size=4", "ppo.generation.n=2",
         "ppo.generation.max_new_tokens=4", "ppo.mini_batch_size=8", "ppo.ppo_epochs=1", "plugins=[]")


def small_config(tmp_path, *extra):
    return load_config([], list(DEMO_OVERRIDES) + list(SMALL) + [f"trainer.output_dir={tmp_path}", *extra])


@pytest.fixture
def api_1_0(monkeypatch):
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.setitem(BUILTIN_MODULES, "api-1-0", "rlcore_api_1_0:Api10Plugin")
    yield
    sys.modules.pop("rlcore_api_1_0", None)


def test_the_plugin_api_version_is_published():
    from rlcore.testing import run_cli

    major, minor = (int(p) for p in rlcore.PLUGIN_API_VERSION.split("."))
    assert (major, minor) >= (1, 1)
    code, out, _ = run_cli(["plugins"])
    assert code == 0 and f"plugin API {rlcore.PLUGIN_API_VERSION} (rlcore {rlcore.__version__}" in out.splitlines()[-1]


def test_a_plugin_written_for_plugin_api_1_0_still_trains(api_1_0, tmp_path):
    from rlcore.trainer.loop import Trainer

    cfg = small_config(tmp_path, "plugins=[api-1-0]")
    pm = build_plugin_manager(["api-1-0"])
    with pytest.warns(DeprecationWarning) as caught:
        trainer = Trainer(cfg, pm, DistInfo())
        trainer.train()
    messages = " ".join(str(w.message) for w in caught)
    assert "plugin 'api-1-0'" in messages and "lacks wait()" in messages and "lacks generation_share()" in messages
    assert "prepare() takes no fsdp=" in messages
    assert trainer.status == "completed" and trainer.state.step == 1
    built = pm.get_plugin("api-1-0").built
    assert built["reshard"].prepared == ["actor", "critic"]  # the critic's fsdp= was left out
    assert (1, True) in built["checkpoint"].asked  # and the run ended with the default wait()


def test_base_classes_give_the_methods_added_later(api_1_0, rlcore_pm, rlcore_register):
    from rlcore_api_1_0 import NeverSaves

    from rlcore.hookspecs import hookimpl
    from rlcore.protocols import CheckpointPolicy, CheckpointPolicyBase, GenerationShare, SamplingParams
    from rlcore.protocols import ReshardPolicy, ReshardPolicyBase

    class Layout(ReshardPolicyBase):
        def prepare(self, model, role, fsdp=None):
            return model

        def generation(self, model):
            raise NotImplementedError

    class Saver(NeverSaves, CheckpointPolicyBase):  # the 1.0 policy, brought up to date by inheriting
        pass

    class Plugin:
        @hookimpl
        def rlcore_reshard_policy(self):
            return Layout()

        @hookimpl
        def rlcore_checkpoint_policy(self):
            return Saver()

    rlcore_register(Plugin, "based")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is missing: no warning
        layout = rlcore_pm.build("rlcore_reshard_policy", fsdp=None, remeshing=None, dist=DistInfo())
        saver = rlcore_pm.build("rlcore_checkpoint_policy", trainer=None, dist=DistInfo())
    assert isinstance(layout, Layout) and isinstance(layout, ReshardPolicy)
    assert isinstance(saver, Saver) and isinstance(saver, CheckpointPolicy) and saver.wait() is None
    share = layout.generation_share([[1, 2]], SamplingParams())
    assert isinstance(share, GenerationShare) and share.rows is None and layout.stats() == {}
