"""The ``streaming`` plugin: parquet shards read row group by row group, at bounded memory.

Select it with ``--plugins streaming`` (or ``plugins: [streaming]``). It answers the dataset provider
hook for splits that have files; the built-in demo and ``data.custom_cls`` stay with the default
provider. Every row is read exactly once per epoch across ranks and DataLoader workers; a window of
``data.shuffle_buffer`` rows is shuffled at a time; the loader's position is resumable. See
:mod:`rlcore.data.streaming` for the details.
"""

from __future__ import annotations

from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_preflight(config):
    from rlcore.config.schema import DataConfig

    if config["data"]["cache_dir"] != DataConfig().cache_dir:
        import logging

        logging.getLogger(__name__).warning("config key 'data.cache_dir' has no effect in this run: the 'streaming' "
                                            "plugin reads the files itself, without the tokenized cache")


@hookimpl
def rlcore_dataset_provider(config, tokenizer, split, dist):
    files = config.train_files if split == "train" else config.val_files
    if config.custom_cls.path or not files:
        return None
    from rlcore.data.streaming import build_streaming_dataset

    return build_streaming_dataset(config, tokenizer, split, dist)
