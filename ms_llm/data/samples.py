"""The sample order of a run over indexed datasets: built once, cached in the run folder, mapped.

The launcher builds it before any worker starts (numpy only); workers map the same files.
<run>/data/samples-<key>/ holds, per split and dataset, megatron-core's document, sample and
shuffle indices (.npy), the blend's two arrays when there are several datasets, and
manifest.json, written last and renamed into place with the folder; <run>/data/samples.json
names the folder for the workers. The key hashes everything the order depends on: each .idx
(document lengths), each .bin's size, seq_len, seed, split, weights and the number of training
samples (steps * global batch). The same inputs map the cached order, changed ones build a new
one. A checkpoint records the order's identity, which leaves out its length: a resume that
asks for more steps keeps the order (Megatron's indices for more samples within the same
epochs start the same), one whose order differs is refused (sampler.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ms_llm.data.blend import blend_order, normalize, split_bounds
from ms_llm.data.gpt import GPTIndices, GPTSamples, build_indices, epoch_plan
from ms_llm.data.indexed import IndexedDataset, bin_path, idx_path
from ms_llm.data.sampler import IndexedBatchSampler, ValidBatches
from ms_llm.errors import ConfigError

SPLITS = ("train", "valid")     # the test share is held out, never read
POINTER = "samples.json"        # names the order the launcher built last


@dataclass(frozen=True)
class DataSpec:
    paths: tuple[str, ...]
    weights: tuple[float, ...]                 # empty: each dataset weighs its tokens in the split
    split: tuple[float, float, float]
    seq_len: int
    seed: int
    train_samples: int

    @classmethod
    def of(cls, train: Any) -> "DataSpec":
        """From a TrainConfig whose train.data.paths are set."""
        d = train.data
        return cls(tuple(d.paths), tuple(d.weights), d.split_fractions(), train.seq_len, train.seed,
                   train.steps * train.global_batch_size)

    def settings(self) -> dict:
        """What the order depends on besides the files (whose paths may differ between nodes)."""
        return json.loads(json.dumps({k: v for k, v in asdict(self).items() if k != "paths"}))

    def key(self) -> str:
        """Hashes each .idx (the document lengths: all of the data the order reads), each .bin's size
        and the settings, so nodes holding their own copies of the data agree on it."""
        files = []
        for prefix in self.paths:
            for p in (bin_path(prefix), idx_path(prefix)):
                if not p.is_file():
                    raise ConfigError(f"train.data.paths: {p} does not exist; a dataset is PREFIX.bin + PREFIX.idx")
            with open(idx_path(prefix), "rb") as f:
                files.append([hashlib.file_digest(f, "sha256").hexdigest(), bin_path(prefix).stat().st_size])
        return _digest({"settings": self.settings(), "files": files})


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def build(spec: DataSpec, cache_dir: Path) -> Path:
    """The cached order's folder, built unless these inputs built it before; cache_dir/samples.json
    then names it for the workers."""
    cache_dir = Path(cache_dir)
    key = spec.key()
    folder = cache_dir / f"samples-{key}"
    if not (folder / "manifest.json").is_file():
        _build(spec, key, folder)
    pointer = cache_dir / f".{POINTER}.{socket.gethostname()}.{os.getpid()}"
    pointer.write_text(json.dumps({"key": key}))
    os.replace(pointer, cache_dir / POINTER)
    return folder


def _build(spec: DataSpec, key: str, folder: Path) -> None:
    datasets = [IndexedDataset(p) for p in spec.paths]
    tmp = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = {"key": key, "settings": spec.settings(), "paths": list(spec.paths),
                "max_token": [ds.max_token() for ds in datasets]}
    for s, name in enumerate(SPLITS):
        manifest[name] = _build_split(spec, datasets, s, name, tmp)
    # The training order without its length: what a checkpoint records. More steps within the
    # same epochs extend the order and keep it, so such a resume stays sample-exact.
    plans = [epoch_plan(t, n, spec.seq_len) if n else None
             for t, n in zip(manifest["train"]["tokens"], manifest["train"]["counts"])]
    manifest["order"] = _digest({"settings": {k: v for k, v in spec.settings().items() if k != "train_samples"},
                                 "sizes": [hashlib.sha256(ds.sizes.tobytes()).hexdigest() for ds in datasets],
                                 "plans": plans})
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    try:
        os.rename(tmp, folder)
    except OSError:                    # another node sharing the folder built the same bytes first
        shutil.rmtree(tmp, ignore_errors=True)


def _build_split(spec: DataSpec, datasets: list[IndexedDataset], s: int, name: str, out: Path) -> dict:
    docs = [np.arange(*split_bounds(spec.split, len(ds))[s], dtype=np.int32) for ds in datasets]
    tokens = [int(ds.sizes[d].sum(dtype=np.int64)) for ds, d in zip(datasets, docs)]
    weights = normalize(spec.weights or tokens) if sum(tokens) else np.zeros(len(datasets))
    if name == "train":
        size = spec.train_samples
    else:   # one pass over the valid documents, the scarcest dataset not repeated
        per_epoch = [max(0, (t - 1) // spec.seq_len) for t in tokens]
        size = int(min((e / w for e, w in zip(per_epoch, weights) if w > 0), default=0))
    if len(datasets) == 1:
        counts = [size]
    else:
        dataset_of, sample_of = blend_order(weights, size)
        np.save(out / f"{name}-blend-dataset.npy", dataset_of)
        np.save(out / f"{name}-blend-sample.npy", sample_of)
        counts = np.bincount(dataset_of, minlength=len(datasets)).tolist()
    for d, (ds, n) in enumerate(zip(datasets, counts)):
        if n == 0:
            continue
        if tokens[d] <= spec.seq_len:
            raise ConfigError(f"train.data.split: the {name} split of {ds.prefix} has {tokens[d]} tokens, fewer than "
                              f"one sample of seq_len + 1 = {spec.seq_len + 1}; give it more data or a larger share")
        ix = build_indices(ds.sizes, docs[d], spec.seq_len, n, spec.seed)
        for part, array in asdict(ix).items():
            np.save(out / f"{name}-{d}-{part}.npy", array)
    return {"samples": int(size), "counts": [int(c) for c in counts], "tokens": tokens}


class BlendedSamples:
    """One split's samples in order: len, rows(order) -> (n, seq_len + 1) int64."""

    def __init__(self, folder: Path, manifest: dict, name: str, datasets: list[IndexedDataset], seq_len: int):
        self.order, self.seq_len, self.size = manifest["order"], seq_len, manifest[name]["samples"]

        def load(part: str) -> np.ndarray:
            return np.load(folder / f"{name}-{part}.npy", mmap_mode="r", allow_pickle=False)

        self.parts = {d: GPTSamples(ds, GPTIndices(load(f"{d}-document"), load(f"{d}-sample"), load(f"{d}-shuffle")),
                                    seq_len)
                      for d, (ds, n) in enumerate(zip(datasets, manifest[name]["counts"])) if n}
        many = len(datasets) > 1
        self.dataset_of = load("blend-dataset") if many else None
        self.sample_of = load("blend-sample") if many else None

    def __len__(self) -> int:
        return self.size

    def rows(self, order: np.ndarray) -> np.ndarray:
        if self.dataset_of is None:
            return self.parts[0].rows(order)
        out = np.empty((len(order), self.seq_len + 1), dtype=np.int64)
        which, within = self.dataset_of[order], self.sample_of[order]
        for d, part in self.parts.items():
            mine = which == d
            if mine.any():
                out[mine] = part.rows(within[mine])
        return out


def open_split(spec: DataSpec, cache_dir: Path, name: str) -> BlendedSamples:
    """Map the order the launcher built (cache_dir/samples.json names it): workers hash nothing."""
    pointer = Path(cache_dir) / POINTER
    if not pointer.is_file():
        raise ConfigError(f"train.data.paths: no sample order in {cache_dir}; start workers with `ms-llm train` "
                          "(it builds the order before they start)")
    folder = Path(cache_dir) / f"samples-{json.loads(pointer.read_text())['key']}"
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["settings"] != spec.settings():
        raise ConfigError(f"train.data: the sample order in {folder} was built for {manifest['settings']}, this "
                          f"worker has {spec.settings()}; start workers with `ms-llm train` on the same config")
    return BlendedSamples(folder, manifest, name, [IndexedDataset(p) for p in spec.paths], spec.seq_len)


def max_token(folder: Path) -> tuple[int, str]:
    """The largest token id over the datasets, and the prefix holding it."""
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    ids = manifest["max_token"]
    d = int(np.argmax(ids))
    return int(ids[d]), manifest["paths"][d]


def train_sampler(train: Any, cache_dir: Path) -> IndexedBatchSampler:
    """The training order of a TrainConfig with train.data.paths, as the launcher built it."""
    return IndexedBatchSampler(open_split(DataSpec.of(train), cache_dir, "train"), train.global_batch_size,
                               train.seed)


def valid_batches(train: Any, cache_dir: Path) -> Optional[ValidBatches]:
    """Fixed validation batches, or None when the valid split holds less than one global batch."""
    valid = ValidBatches(open_split(DataSpec.of(train), cache_dir, "valid"), train.global_batch_size)
    return valid if valid.available() else None
