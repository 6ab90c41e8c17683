"""msrun worker for tests/mindspore/test_zero_mindspore.py: the MindSpore LLaMA trained data parallel by
the shared ZeRO engine, on the same model, data and settings as the torch workers. Rank 0
writes the final parameters and losses, every rank its model-state bytes. Each step also checks
the shared loop's checkpoint fence contract: forward and backward leave every tensor of the
training state (MsTrainerState.held: engine shards, moments, weights) as the last update left
it, so an overlapped snapshot copying them before ZeroStep's fence sees one step's values."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import ops
from mindspore.communication import get_group_size, get_rank, init
from safetensors.numpy import save_file

from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.state import MsTrainerState
from ms_llm.mindspore.zero import MsZeroDataParallel
from ms_llm.strategy.plan import plan
from ms_llm.zero import zero_plan
from ms_llm.zero.engine import EngineConfig

from zero_cases import MICRO, GLOBAL_BATCH, batches, case_name, model_for, strategy_for, train_config


def run_case(rank: int, world: int, case: str, out: Path) -> None:
    stage, opt_name, shard, dtype, offload = case.split(":")[:5]
    strategy = strategy_for(world, int(stage), int(shard), dtype, offload == "1")
    train = train_config(world, opt_name)
    model = model_for(case)
    mplan = plan(model, strategy, train, world)
    net = Transformer(model)
    net.init_weights(1 + rank)                 # replicas start different: the engine broadcasts rank 0's
    runner = MsZeroDataParallel(LossCell(net), zero_plan(mplan), rank, EngineConfig.from_job(mplan.strategy, train),
                                net=net)
    per_rank = GLOBAL_BATCH // world
    mean = ops.AllReduce()
    losses, state_bytes = [], None
    held = MsTrainerState(SimpleNamespace(runner=runner), mplan, rank, world)

    def state_values() -> dict[str, np.ndarray]:
        return {name: t.asnumpy().copy() for name, (_, t) in held.held(create=False).items()}
    after_update = state_values()
    for step in batches():
        local = step[rank * per_rank:(rank + 1) * per_rank].astype(np.int32)
        total = 0.0
        for i, micro in enumerate(np.split(local, MICRO)):
            inputs, labels = ms.Tensor(micro[:, :-1]), ms.Tensor(micro[:, 1:])
            if i < MICRO - 1:
                with runner.no_sync():
                    loss = runner.backward(inputs, labels, scale=1 / MICRO)
            else:
                loss = runner.backward(inputs, labels, scale=1 / MICRO)
            total += float(loss.asnumpy())
        state_bytes = runner.model_state_bytes()
        now = state_values()                    # where ZeroStep calls the loop's fence
        changed = [n for n, v in after_update.items() if not np.array_equal(now[n], v)]
        assert not changed, f"rank {rank}: forward/backward wrote the training state: {changed[:3]}"
        runner.step(train.optimizer.lr)
        before, after_update = now, state_values()
        assert any(not np.array_equal(before[n], v) for n, v in after_update.items()), "the update went unseen"
        losses.append(float(mean(ms.Tensor([total / world], ms.float32)).asnumpy()[0]))
    gather = runner.engine.gather
    gathers = {"gathers": gather.gathers, "peak_live": gather.peak_live} if gather is not None else {}
    if gather is not None:
        gather.gather_all()
    name = case_name(case)
    if rank == 0:
        save_file({n: p.asnumpy().astype(np.float32) for n, p in net.parameters_and_names()},
                  str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, **gathers}))
    (out / f"{name}.bytes{rank}.json").write_text(json.dumps(state_bytes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help="stage:optimizer:shard:dtype:offload[:moe],...")
    args = ap.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    for case in args.cases.split(","):
        run_case(get_rank(), get_group_size(), case, Path(args.out))


if __name__ == "__main__":
    main()
