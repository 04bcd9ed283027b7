"""The demo model directory is built once and loaded afterwards; either way training starts from the
same random state, so a first ``rlcore train`` and a later one give the same results."""

import json
import os

import pytest
import torch

from rlcore.protocols import DistInfo
from rlcore.demo import demo_model


def test_building_thedemo_model_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    path = demo_model(str(tmp_path), DistInfo())  # builds
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert torch.equal(torch.get_rng_state(), before)
    assert demo_model(str(tmp_path), DistInfo()) == path  # loads
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mistral"])
def test_the_tiny_tokenizer_loads_back_as_saved_and_keeps_the_spaces(tmp_path, arch):
    from rlcore.testing import make_tiny_model_dir
    from rlcore.trainer.models import load_tokenizer

    path = make_tiny_model_dir(str(tmp_path / arch), arch=arch)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"  # the generic class, by its portable name
    tok = load_tokenizer(path)  # through from_pretrained, as the trainer loads it
    ids = tok("c k a f")["input_ids"]
    assert ids == tok.convert_tokens_to_ids(["c", "k", "a", "f"])
    assert tok.decode(ids) == "c k a f"
    assert tok.batch_decode([ids + [tok.eos_token_id]], skip_special_tokens=True) == ["c k a f"]
    out = tmp_path / f"{arch}-saved"  # what an export writes loads back the same way
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    assert load_tokenizer(str(out)).decode(ids) == "c k a f"


def test_the_tiny_tokenizer_fixture_decodes_words_with_spaces(tiny_tokenizer):
    assert tiny_tokenizer.decode(tiny_tokenizer("g h i j")["input_ids"]) == "g h i j"
