"""msrun worker for tests/mindspore/test_ms_weight_decay.py: the MindSpore model trained at dp2 by
the shared ZeRO engine (stage 2: segments that hold pieces of 1-D and 2-D parameters) with
train.optimizer.weight_decay_1d false, on decay_cases' model and batches. Rank 0 writes the
final parameters to OUT/zero2.safetensors.

    msrun --worker_num=2 ... python tests/helpers/decay_ms_worker.py OUT
"""
from __future__ import annotations

import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore.communication import get_group_size, get_rank, init
from safetensors.numpy import save_file

from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.zero import MsZeroDataParallel
from ms_llm.strategy.plan import plan
from ms_llm.zero import zero_plan
from ms_llm.zero.engine import EngineConfig

from decay_cases import MODEL, batches, job


def main() -> None:
    out = Path(sys.argv[1])
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    rank, world = get_rank(), get_group_size()
    j = job({"dp": world, "zero": {"stage": 2}}, MODEL)
    mplan = plan(j.model, j.strategy, j.train, world)
    net = Transformer(j.model)
    net.init_weights(j.train.seed)
    runner = MsZeroDataParallel(LossCell(net), zero_plan(mplan), rank, EngineConfig.from_job(mplan.strategy, j.train))
    micro = mplan.micro_batches
    for rows in batches(j.model.vocab_size):
        local = np.split(rows, world)[rank].astype(np.int32)
        for i, mb in enumerate(np.split(local, micro)):
            inputs, labels = ms.Tensor(mb[:, :-1]), ms.Tensor(mb[:, 1:])
            if i < micro - 1:
                with runner.no_sync():
                    runner.backward(inputs, labels, scale=1 / micro)
            else:
                runner.backward(inputs, labels, scale=1 / micro)
        runner.step(j.train.optimizer.lr)
    if rank == 0:
        save_file({n: p.asnumpy() for n, p in net.parameters_and_names()}, str(out / "zero2.safetensors"))


if __name__ == "__main__":
    main()
