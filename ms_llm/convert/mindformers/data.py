"""The Megatron dataset section of a MindFormers YAML <-> train.data.

MindFormers 2.x reads Megatron indexed datasets (PREFIX.bin / PREFIX.idx, the format
`ms-llm prepare-data` writes) through BlendedMegatronDatasetDataLoader: `config.data_path` is
Megatron's flat [weight, prefix, weight, prefix, ...] list, `config.split` its train,valid,test
shares, `sizes` the sample counts per split. Other loaders (MindRecord, Hugging Face) are left to
the unused-key warnings.
"""
from __future__ import annotations

from ms_llm.config.train import DataConfig
from ms_llm.convert.common import Fields

LOADER = "BlendedMegatronDatasetDataLoader"
# Loader settings whose value (None: any) changes nothing ms_llm's data order models: worker counts,
# column plumbing, and the GPT sample options at their Megatron defaults.
NEUTRAL = {"config.eod_mask_loss": (False,), "config.reset_position_ids": (False,),
           "config.reset_attention_mask": (False,), "config.create_attention_mask": None,
           "config.create_compressed_eod_mask": (False,),
           "config.eod_pad_length": None, "datasets_type": ("GPTDataset",)}
DATASET_NEUTRAL = ("input_columns", "construct_args_key", "drop_remainder", "num_parallel_workers",
                   "python_multiprocessing", "numa_enable", "prefetch_size")


def read_data(f: Fields, loader: str, seq_len: int, warnings: list[str]) -> tuple[dict, int]:
    """train.data from the loader section at `loader` (train_dataset.data_loader, or
    train_dataset.dataloader in the pynative layout), and the training samples it names (0: unknown)."""
    if f.peek(f"{loader}.type") != LOADER:
        return {}, 0
    f.get(f"{loader}.type", str)
    dataset = loader.rsplit(".", 1)[0]
    f.accept_usual(NEUTRAL, f"{loader}.")
    f.used.update(f"{dataset}.{key}" for key in DATASET_NEUTRAL if f.has(f"{dataset}.{key}"))
    if f.peek("train_dataset_task.dataset_config") == f.peek("train_dataset"):
        f.used.add("train_dataset_task.dataset_config")          # the usual YAML alias of train_dataset
    cfg = f"{loader}.config"
    if f.peek(f"{cfg}.seed") == f.peek("seed", 1234):
        f.used.add(f"{cfg}.seed")                                # the run's seed, as ms_llm uses it for data order
    flat = f.get(f"{cfg}.data_path", list, [], ir="train.data.paths")
    if len(flat) % 2 or not all(isinstance(p, str) for p in flat[1::2]):
        raise f.error(f"{cfg}.data_path", f"got {flat!r}; expected Megatron's [weight, prefix, weight, prefix, ...]")
    try:
        weights = tuple(float(w) for w in flat[0::2])
    except (TypeError, ValueError):
        raise f.error(f"{cfg}.data_path", f"weights {flat[0::2]!r} are not numbers") from None
    data: dict = {"paths": tuple(flat[1::2])}
    if len(set(weights)) > 1:
        data["weights"] = weights
    split = str(f.raw(f"{cfg}.split", "969,30,1", ir="train.data.split")).replace(" ", "")
    data["split"] = split
    length = f.get(f"{cfg}.seq_length", int, seq_len)
    if length != seq_len:
        raise f.error(f"{cfg}.seq_length", f"{length} differs from the model's seq_length {seq_len}; make them equal")
    sizes = f.get(f"{loader}.sizes", list, [])
    samples = int(sizes[0]) if sizes and isinstance(sizes[0], int) else 0
    return data, samples


def write_data(data: DataConfig, seq_len: int, samples: int, seed: int) -> dict:
    """A train_dataset section for BlendedMegatronDatasetDataLoader, as MindFormers 2.x ships it."""
    weights = data.weights or (1.0,) * len(data.paths)
    flat = [x for w, p in zip(weights, data.paths) for x in (f"{w:g}", p)]
    return {"data_loader": {"type": LOADER, "datasets_type": "GPTDataset", "sizes": [samples, 0, 0],
                            "config": {"seed": seed, "split": data.split, "seq_length": seq_len,
                                       "eod_mask_loss": False, "reset_position_ids": False,
                                       "create_attention_mask": False, "reset_attention_mask": False,
                                       "data_path": flat}},
            "input_columns": ["input_ids", "labels", "loss_mask", "position_ids"],
            "construct_args_key": ["input_ids", "labels", "loss_mask", "position_ids"],
            "drop_remainder": True, "num_parallel_workers": 8}
