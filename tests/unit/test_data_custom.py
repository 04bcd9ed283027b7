"""User dataset classes from ``data.custom_cls``: the seed's StreamingRLHFDataset as written, packages, errors."""

from __future__ import annotations

import os
import textwrap

import pytest

from rlcore.config.schema import CustomClsConfig, DataConfig
from rlcore.data.collate import ensure_input_ids
from rlcore.data.custom import load_custom_class
from rlcore.data.loader import PromptLoader
from rlcore.data.provider import build_dataset, check_data_files
from rlcore.data.synthetic import write_parquet_shards
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

# The seed article's example as the project ships it (its one comment translated).
SEED_DATASET = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "streaming_dataset.py")


@pytest.fixture
def seed_config(tmp_path):
    files = write_parquet_shards(str(tmp_path / "parquet"), [11, 6], words=(1, 5))
    return DataConfig(train_files=files, max_prompt_length=16,
                      custom_cls=CustomClsConfig(path=SEED_DATASET, name="StreamingRLHFDataset"))


def test_seed_streaming_dataset_runs_as_written(seed_config, tiny_tokenizer):
    check_data_files(seed_config)
    ds = build_dataset(seed_config, tiny_tokenizer, "train", DistInfo())
    assert type(ds).__name__ == "StreamingRLHFDataset" and ds.data_files == list(seed_config.train_files)
    loader = PromptLoader(ds, seed_config, batch_size=4, seed=0, dist=DistInfo())
    batches = [ensure_input_ids(loader.next_batch(), tiny_tokenizer, seed_config) for _ in range(4)]
    assert loader.epoch == 0 and all(len(b) == 4 for b in batches)
    for row in batches[0]:
        assert set(row) == {"prompt", "input_ids", "ground_truth", "data_source", "id"}  # every column, for rewards
        assert row["input_ids"] == tiny_tokenizer(row["prompt"])["input_ids"]
    loader.next_batch()  # 17 rows -> 4 whole batches, then the next epoch
    assert loader.epoch == 1


def test_seed_dataset_is_split_over_ranks(seed_config, tiny_tokenizer):
    prompts = []
    for rank in range(2):
        ds = build_dataset(seed_config, tiny_tokenizer, "train", DistInfo(rank=rank, world_size=2))
        loader = PromptLoader(ds, seed_config, batch_size=1, seed=0, dist=DistInfo(rank=rank, world_size=2))
        prompts += [loader.next_batch()[0]["prompt"] for _ in range(8)]
    all_prompts = [r["prompt"] for r in build_dataset(seed_config, tiny_tokenizer, "train", DistInfo())]
    assert sorted(prompts) == sorted(all_prompts[:16])  # rank r takes rows r, r+2, …


def test_pkg_module_and_kwargs(tmp_path, monkeypatch, tiny_tokenizer):
    pkg = tmp_path / "site" / "mydata_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "prompts.py").write_text(textwrap.dedent('''
        class Repeat:
            def __init__(self, data_files, prompt_key="prompt", times=1):
                self.rows = [{prompt_key: "a b", "n": i} for i in range(times)]
            def __len__(self):
                return len(self.rows)
            def __getitem__(self, i):
                return self.rows[i]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cfg = DataConfig(prompt_key="q", custom_cls=CustomClsConfig(path="pkg://mydata_pkg.prompts", name="Repeat",
                                                                kwargs={"times": 3}))
    ds = build_dataset(cfg, tiny_tokenizer, "train", DistInfo())
    assert len(ds) == 3 and ds[2] == {"q": "a b", "n": 2}
    assert len(build_dataset(cfg, tiny_tokenizer, "val", DistInfo())) == 0
    with pytest.raises(DataError, match=r"Repeat\(data_files, prompt_key='prompt', \*\*\['nope'\]\) failed"):
        build_dataset(DataConfig(custom_cls=CustomClsConfig(path=cfg.custom_cls.path, name="Repeat",
                                                            kwargs={"nope": 1})), tiny_tokenizer, "train", DistInfo())


def test_custom_class_errors(tmp_path):
    with pytest.raises(DataError, match=r"data.custom_cls.path: file not found: .*missing\.py"):
        load_custom_class(CustomClsConfig(path=str(tmp_path / "missing.py"), name="X"))
    with pytest.raises(DataError, match="cannot import module 'no_such_module_xyz'"):
        load_custom_class(CustomClsConfig(path="pkg://no_such_module_xyz", name="X"))
    mod = tmp_path / "ds.py"
    mod.write_text("class Alpha:\n    pass\n\nclass Beta:\n    pass\n")
    with pytest.raises(DataError, match=r"no class 'Gamma' in .*ds\.py; classes defined there: Alpha, Beta"):
        load_custom_class(CustomClsConfig(path=str(mod), name="Gamma"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(DataError, match=r"importing .*broken\.py failed: RuntimeError: boom"):
        check_data_files(DataConfig(custom_cls=CustomClsConfig(path=str(broken), name="X")))


def test_ensure_input_ids_truncates_or_rejects(tiny_tokenizer):
    rows = [{"prompt": "a b c d e f", "x": 1}, {"prompt": "a", "input_ids": [5, 6, 7, 8]}]
    left = ensure_input_ids(rows, tiny_tokenizer, DataConfig(max_prompt_length=3, truncation="left"))
    full = tiny_tokenizer("a b c d e f")["input_ids"]
    assert left[0]["input_ids"] == full[-3:] and left[0]["x"] == 1 and left[1]["input_ids"] == [6, 7, 8]
    right = ensure_input_ids(rows, tiny_tokenizer, DataConfig(max_prompt_length=3, truncation="right"))
    assert right[0]["input_ids"] == full[:3] and "input_ids" not in rows[0]
    with pytest.raises(DataError, match=r"2 of 2 prompt\(s\) exceed data.max_prompt_length=3 .*cannot be filtered"):
        ensure_input_ids(rows, tiny_tokenizer, DataConfig(max_prompt_length=3))
    with pytest.raises(DataError, match=r"no column 'prompt' .* columns: q"):
        ensure_input_ids([{"q": "a"}], tiny_tokenizer, DataConfig())


def test_overlong_rows_of_a_custom_dataset_are_dropped_and_the_batch_refilled(tiny_tokenizer):
    from rlcore.config.schema import DataConfig
    from rlcore.data.collate import BatchFiller
    from rlcore.data.loader import PromptLoader
    from rlcore.protocols import DistInfo

    # every third prompt is over the limit of 4 tokens
    rows = [{"prompt": "a b c d e f g" if i % 3 == 0 else "a b", "i": i} for i in range(30)]
    config = DataConfig(max_prompt_length=4, shuffle=False)
    loader = PromptLoader(rows, config, 4, 0, DistInfo())
    fill = BatchFiller(loader, tiny_tokenizer, config, 4)
    batches = [fill(loader.next_batch()) for _ in range(4)]
    assert all(len(b) == 4 for b in batches)
    seen = [r["i"] for b in batches for r in b]
    assert seen == [i for i in range(30) if i % 3][:16]  # in order, none lost, none repeated
    assert all(len(r["input_ids"]) <= 4 for b in batches for r in b)
    # the carried rows are part of the checkpoint state: a resumed filler goes on where this one is
    while not fill._carry:
        fill(loader.next_batch())
    state = fill.state_dict()
    assert [r["i"] for r in state["carry"]] and state["offset"] == loader.state_dict()["offset"]
    expected = [r["i"] for r in fill(loader.next_batch())]
    resumed_loader = PromptLoader(rows, config, 4, 0, DistInfo())
    resumed = BatchFiller(resumed_loader, tiny_tokenizer, config, 4)
    resumed.load_state_dict(state)
    assert [r["i"] for r in resumed(resumed_loader.next_batch())] == expected
    old = {k: v for k, v in state.items() if k != "carry"}  # a checkpoint from before carried rows were kept
    resumed.load_state_dict(old)
    assert resumed._carry == []
    resumed.load_state_dict({**state, "world_size": 2})  # another world size: the loader restarts, rows dropped
    assert resumed._carry == []
    everything_long = [{"prompt": "a b c d e f g"} for _ in range(8)]
    loader = PromptLoader(everything_long, config, 4, 0, DistInfo())
    with pytest.raises(DataError, match="fewer than 4 prompts within data.max_prompt_length=4"):
        BatchFiller(loader, tiny_tokenizer, config, 4)(loader.next_batch())


def test_iterable_custom_dataset_too_small_fails_before_the_models_load(tmp_path, monkeypatch):
    from rlcore.config.loader import load_config
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.trainer import models
    from rlcore.demo import demo_model
    from rlcore.trainer.components import build_components

    mod = tmp_path / "few.py"
    mod.write_text(textwrap.dedent('''
        from torch.utils.data import IterableDataset

        class Few(IterableDataset):
            def __init__(self, data_files, prompt_key="prompt"):
                self.key = prompt_key
            def __iter__(self):
                return iter([{self.key: "a b"} for _ in range(3)])
    '''))

    def forbidden(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(models, "load_causal_lm", forbidden)
    cfg = load_config(overrides=[f"data.custom_cls.path={mod}", "data.custom_cls.name=Few",
                                 "ppo.rollout_batch_size=8", f"trainer.output_dir={tmp_path / 'run'}",
                                 f"actor.model_path={demo_model(str(tmp_path / 'run'), DistInfo())}"])
    with pytest.raises(DataError, match="no full batch of 8 prompts"):
        build_components(cfg, build_plugin_manager([]), DistInfo())
