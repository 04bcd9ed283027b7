"""The seed's user dataset class, usable as written:

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
                yield {self.prompt_key: sample[self.prompt_key]}
