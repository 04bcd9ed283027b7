"""Data benchmark: peak memory, time to first batch and sustained batches/s of the prompt pipelines.

Corpus (generated locally, nothing downloaded): synthetic prompts of a Zipf-distributed vocabulary of
~10k pseudo-words, lengths log-normal around 1.5 kB (8 to 2,000 words, ~200 BPE tokens), written as
uncompressed parquet shards of ~100 MiB (row groups of 8,192 rows). A BPE tokenizer (8k vocabulary)
is trained on a sample. The first ``--shards`` shards form the base corpus (>= 3 GB); all
``2 x --shards`` form the doubled corpus.

Variants, each in a fresh process. Memory is per process tree, sampled every 0.1 s as the sum of
proportional set sizes (PSS), reported in full and for anonymous pages only: a memory-mapped cache
counts in PSS for the file pages it touches (shared, reclaimable page cache), not in anonymous
memory. Peaks are given for the whole run and for the build (until the dataset exists).

* ``concat``    — ``datasets.load_dataset(parquet, keep_in_memory=True)`` per shard, then
  ``concatenate_datasets`` and a ``filter`` of overlong prompts (tokenizes everything), the approach
  the seed warns about;
* ``streaming`` — the ``streaming`` plugin's dataset (base and doubled corpus);
* ``cold`` / ``warm`` — the default provider with ``data.cache_dir``: the first build, then a start
  that maps the cached Arrow table.

Each variant then draws ``--batches`` batches of ``--batch-size`` prompts through ``PromptLoader``
(``num_workers=0``: one process, so memory is comparable) and reports batches/s.

Run:   python bench/bench_data.py all --dir /tmp/rlcore-bench-data --json bench-data.json
       python bench/bench_data.py all --dir /tmp/rlcore-bench-data-small --shard-mib 4 --shards 4  (smoke)
The corpus and caches are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402

ROW_GROUP = 8192
MAX_PROMPT_TOKENS = 1024


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------


def _vocabulary(seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    syllables = ["ka", "ro", "mi", "tu", "sel", "an", "ve", "lo", "pri", "dat", "on", "er", "is", "qu",
                 "ment", "ta", "ble", "gra", "ph", "ion", "st", "ex", "or", "ul"]
    return sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(20000)})


def _text_block(vocab: list[str], words: int, rng: Any) -> str:
    """``words`` Zipf-distributed words joined by spaces (vectorised)."""
    import numpy as np

    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    cdf = np.cumsum(weights / weights.sum())
    idx = np.minimum(np.searchsorted(cdf, rng.random(words)), len(vocab) - 1)
    return " ".join(np.asarray(vocab, dtype=object)[idx])


def generate(directory: str, shards: int, shard_mib: float, seed: int = 0) -> list[str]:
    """Write ``shards`` parquet shards of about ``shard_mib`` MiB each; return their paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(seed)
    base = _text_block(vocab, 40_000_000, rng)  # ~270 MB of text; prompts are random slices of it
    schema = pa.schema([("prompt", pa.string()), ("id", pa.int64()), ("ground_truth", pa.string()),
                        ("data_source", pa.string())])
    paths, next_id = [], 0
    for s in range(shards):
        path = os.path.join(directory, f"train-{s:05d}.parquet")
        paths.append(path)
        if os.path.exists(path):
            next_id += pq.read_metadata(path).num_rows
            continue
        target, written = shard_mib * 2**20, 0
        with pq.ParquetWriter(path + ".part", schema, compression="none", use_dictionary=False) as w:
            while written < target:
                lengths = np.clip(rng.lognormal(np.log(1200), 0.7, ROW_GROUP), 48, 12000).astype(int)
                starts = rng.integers(0, len(base) - 12001, ROW_GROUP)
                prompts = [base[a:a + n].strip() for a, n in zip(starts.tolist(), lengths.tolist())]
                ids = list(range(next_id, next_id + ROW_GROUP))
                next_id += ROW_GROUP
                table = pa.table([prompts, ids, [p.rsplit(" ", 1)[-1] for p in prompts],
                                  ["bench"] * ROW_GROUP], schema=schema)
                w.write_table(table, row_group_size=ROW_GROUP)
                written += sum(lengths.tolist())
        os.replace(path + ".part", path)
    return paths


def train_tokenizer(directory: str, sample_file: str) -> str:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = os.path.join(directory, "tokenizer")
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return out
    texts = pq.ParquetFile(sample_file).read_row_group(0, columns=["prompt"]).column(0).to_pylist()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts[:4000], trainer=trainers.BpeTrainer(vocab_size=8000,
                                                                      special_tokens=["<pad>", "<eos>", "<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------------
# Memory sampling
# ------------------------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _pss_kib(pid: int) -> tuple[int, int]:
    """``(Pss, Pss_Anon)`` of one process in KiB (file-backed pages of a memory map are in Pss only)."""
    out = {"Pss:": 0, "Pss_Anon:": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(" ", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out["Pss:"], out["Pss_Anon:"]


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


class MemorySampler(threading.Thread):
    """Peaks of the summed PSS (all, and anonymous only) of this process and its descendants."""

    def __init__(self, interval: float = 0.1):
        super().__init__(daemon=True)
        self.interval, self.peak_kib, self.peak_anon_kib, self._done = interval, 0, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            sizes = [_pss_kib(p) for p in _tree(os.getpid())]
            self.peak_kib = max(self.peak_kib, sum(a for a, _ in sizes))
            self.peak_anon_kib = max(self.peak_anon_kib, sum(b for _, b in sizes))
            self._done.wait(self.interval)

    def stop(self) -> tuple[int, int]:
        self._done.set()
        self.join()
        return self.peak_kib, self.peak_anon_kib


# ------------------------------------------------------------------------------------------------
# Variants (run in a child process)
# ------------------------------------------------------------------------------------------------


def _concat_dataset(files: list[str], tok: Any, cache: str, workers: int) -> Any:
    import datasets

    parts = [datasets.load_dataset("parquet", data_files=f, split="train", keep_in_memory=True, cache_dir=cache)
             for f in files]
    ds = datasets.concatenate_datasets(parts)

    def short_enough(batch: dict) -> list[bool]:
        return [len(x) <= MAX_PROMPT_TOKENS for x in tok(batch["prompt"])["input_ids"]]

    return ds.filter(short_enough, batched=True, batch_size=1024, num_proc=workers, keep_in_memory=True)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import_rlcore()
    from transformers import AutoTokenizer

    from rlcore.config.schema import DataConfig
    from rlcore.data.loader import PromptLoader
    from rlcore.protocols import DistInfo

    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".parquet"))[: args.shards]
    tok = AutoTokenizer.from_pretrained(os.path.join(args.dir, "tokenizer"))
    cfg = DataConfig(train_files=files, max_prompt_length=MAX_PROMPT_TOKENS, num_workers=0,
                     preprocess_workers=args.workers, cache_dir=os.path.join(args.dir, "cache"),
                     shuffle_buffer=args.shuffle_buffer)
    sampler = MemorySampler()
    sampler.start()
    t0 = time.perf_counter()
    if args.variant == "concat":
        ds = _concat_dataset(files, tok, os.path.join(args.dir, "hf-cache"), args.workers)
    elif args.variant == "streaming":
        from rlcore.data.streaming import build_streaming_dataset

        ds = build_streaming_dataset(cfg, tok, "train", DistInfo())
    else:
        from rlcore.data.provider import build_dataset

        ds = build_dataset(cfg, tok, "train", DistInfo())
    t_built = time.perf_counter() - t0
    build_peak = (sampler.peak_kib, sampler.peak_anon_kib)
    loader = PromptLoader(ds, cfg, args.batch_size, 0, DistInfo())
    first = loader.next_batch()
    ttfb = time.perf_counter() - t0
    if "input_ids" not in first[0]:  # concat: tokenized per batch, as a map-style loader would
        tok([r["prompt"] for r in first])
    t1 = time.perf_counter()
    for _ in range(args.batches):
        batch = loader.next_batch()
        if "input_ids" not in batch[0]:
            tok([r["prompt"] for r in batch])
    rate = args.batches / (time.perf_counter() - t1)
    peak_pss, peak_anon = sampler.stop()
    return {"variant": args.variant, "shards": len(files), "corpus_gb": sum(map(os.path.getsize, files)) / 1e9,
            "rows": len(ds) if hasattr(ds, "__len__") else getattr(ds, "num_rows", None),
            "build_s": t_built, "first_batch_s": ttfb, "batches_per_s": rate,
            "prompts_per_s": rate * args.batch_size, "peak_pss_mb": peak_pss / 1024,
            "peak_anon_mb": peak_anon / 1024, "build_peak_pss_mb": build_peak[0] / 1024,
            "build_peak_anon_mb": build_peak[1] / 1024,
            "peak_rss_main_mb": _hwm_kib() / 1024, "batch_size": args.batch_size}


# ------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------


def _child(args: argparse.Namespace, variant: str, shards: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "variant", variant, "--dir", args.dir, "--shards", str(shards),
           "--batches", str(args.batches), "--batch-size", str(args.batch_size), "--workers", str(args.workers),
           "--shuffle-buffer", str(args.shuffle_buffer)]
    print("+", " ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def run_all(args: argparse.Namespace) -> None:
    t = time.perf_counter()
    paths = generate(args.dir, 2 * args.shards, args.shard_mib)
    train_tokenizer(args.dir, paths[0])
    gen_s = time.perf_counter() - t
    plan = [("streaming", args.shards), ("streaming", 2 * args.shards), ("cold", args.shards),
            ("warm", args.shards), ("concat", args.shards)]
    only = set(args.only.split(",")) if args.only else None
    results = []
    for variant, shards in plan:
        if only is None or variant in only:
            if variant == "cold":
                shutil.rmtree(os.path.join(args.dir, "cache"), ignore_errors=True)
            results.append(_child(args, variant, shards))
    payload = {"environment": environment(), "generate_s": gen_s, "args": vars(args), "results": results,
               "cpu_count": os.cpu_count()}
    write_json(args.json, payload)
    print(json.dumps(payload, indent=1, default=str))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["all", "variant", "generate"])
    p.add_argument("variant", nargs="?", choices=["concat", "streaming", "cold", "warm"])
    p.add_argument("--dir", default="/tmp/rlcore-bench-data")
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--shard-mib", type=float, default=100.0)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="processes for tokenizing (cold cache, concat filter)")
    p.add_argument("--shuffle-buffer", type=int, default=1024)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the corpus and caches")
    p.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    args = p.parse_args()
    if args.command == "variant":
        print(json.dumps(run_variant(args)))
    elif args.command == "generate":
        train_tokenizer(args.dir, generate(args.dir, 2 * args.shards, args.shard_mib)[0])
    else:
        run_all(args)


if __name__ == "__main__":
    main()
