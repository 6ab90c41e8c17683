"""One MindSpore rank for the cross-backend test: `python ckpt_ms_worker.py SRC DST STRATEGY_JSON WORLD RANK`.

Loads its pieces of the target plan from SRC (written by torch ranks) into MindSpore
Parameters through ms_llm.mindspore.checkpoint, then saves those Parameters as rank RANK of
a new checkpoint DST. No MindSpore collectives: ranks meet only in the checkpoint folders."""
import json
import sys

import mindspore as ms
import numpy as np

from ckpt_helpers import plan_for, rank_pieces
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, run_config
from ms_llm.mindspore.checkpoint import load_into, save_items


def main() -> None:
    src, dst, strategy, world, rank = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    plan = plan_for(strategy, world)
    pieces = rank_pieces(plan, rank)
    params = {n: ms.Parameter(ms.Tensor(np.zeros(p.local_shape, np.float32)), name=n) for n, p in pieces.items()}
    load_into(Checkpoint.open(src), pieces, params)
    writer = CheckpointWriter(dst, rank, world, session="mindspore")
    writer.save(9, save_items(pieces, params), state={"step": 9}, config=run_config(plan, "mindspore"))
    writer.close()


if __name__ == "__main__":
    main()
