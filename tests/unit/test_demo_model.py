"""The demo model directory is built once and loaded afterwards; either way training starts from the
same random state, so a first ``rlcore train`` and a later one give the same results."""

import os

import torch

from rlcore.protocols import DistInfo
from rlcore.trainer.components import demo_model


def test_building_thedemo_model_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    path = demo_model(str(tmp_path), DistInfo())  # builds
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert torch.equal(torch.get_rng_state(), before)
    assert demo_model(str(tmp_path), DistInfo()) == path  # loads
    assert torch.equal(torch.get_rng_state(), before)
