"""The seed's user dataset class, with one change: it yields every column of a row, not only the
prompt, so that rewards can read ``ground_truth`` and ``data_source`` (a class that yields the prompt
alone needs a reward that reads nothing else, e.g. a reward model):

    rlcore train data.custom_cls.path=examples/streaming_dataset.py data.custom_cls.name=StreamingRLHFDataset \
        "data.train_files=['/data/parquet/part-00000.parquet', '/data/parquet/part-00001.parquet']"
"""

from datasets import load_dataset
from torch.utils.data import IterableDataset


class StreamingRLHFDataset(IterableDataset):
    def __init__(self, data_files, prompt_key="prompt", **kwargs):
        self.data_files = data_files if isinstance(data_files, list) else [data_files]
        self.prompt_key = prompt_key

    def __iter__(self):
        for file in self.data_files:
            # streamed: one file at a time, never all of them in memory
            ds = load_dataset("parquet", data_files=file, split="train", streaming=True)
            for sample in ds:
                yield dict(sample)  # the prompt (self.prompt_key) and the columns rewards read
