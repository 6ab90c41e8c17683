"""megatron-core's side of tests/data/test_indexed_dataset.py, run with PYTHONPATH=.oracles.

argv[1]: JSON {"ours": prefix we wrote, "out": folder, "gpt": {seed, seq_len, samples, split}}.
Reads our files with megatron-core's IndexedDataset, writes datasets with its
IndexedDatasetBuilder, and saves its GPTDataset train indices over our files; prints JSON.
"""
import json
import sys
import types
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    out = args["out"]
    ours = IndexedDataset(args["ours"])
    result = {"ours": {"dtype": np.dtype(ours.index.dtype).name,
                       "documents": [ours[i].tolist() for i in range(len(ours))],
                       "document_indices": ours.document_indices.tolist()}}

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 60000, int(n)).tolist() for n in rng.integers(0, 40, 12)]
    one = IndexedDatasetBuilder(f"{out}/meg_u16.bin", dtype=np.uint16)       # one sequence per document
    for doc in docs:
        one.add_item(torch.tensor(doc, dtype=torch.int64))
        one.end_document()
    one.finalize(f"{out}/meg_u16.idx")
    multi = IndexedDatasetBuilder(f"{out}/meg_i32.bin", dtype=np.int32)      # documents of 2 sequences
    for a, b in zip(docs[::2], docs[1::2]):
        multi.add_document(torch.tensor(a + b, dtype=torch.int64), [len(a), len(b)])
    multi.finalize(f"{out}/meg_i32.idx")
    result["written"] = docs

    g = args["gpt"]
    tokenizer = types.SimpleNamespace(vocab_size=65000, eod=0, pad=0, unique_identifiers={"class": "probe"})
    config = GPTDatasetConfig(random_seed=g["seed"], sequence_length=g["seq_len"], blend=([args["ours"]], None),
                              split=g["split"], tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=None)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [g["samples"], None, None], lambda: True,
                                                    config).build()
    for name, array in (("document", train.document_index), ("sample", train.sample_index),
                        ("shuffle", train.shuffle_index)):
        np.save(f"{out}/gpt_{name}.npy", array)
    result["train_documents"] = [int(train.indices[0]), int(train.indices[-1]) + 1]
    result["valid_documents"] = [int(valid.indices[0]), int(valid.indices[-1]) + 1] if valid else None
    result["train_sample_3"] = train[3]["tokens"].tolist() + train[3]["labels"][-1:].tolist()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
