"""One process of a MindSpore training job, on Ascend or on a CPU machine, running the shared loop.

    msrun --worker_num=N ... python -m ms_llm.mindspore.worker --run-dir RUN
    python -m ms_llm.mindspore.worker --run-dir RUN          # one process, stand-alone

`ms-llm train` resolves the job once and writes RUN/config.yaml. On Ascend the plan is lowered
to semi_auto_parallel (shard strategies, pipeline stages, parallel optimizer, recompute); on a
CPU machine the same step cell runs stand-alone or DATA_PARALLEL, or the shared ZeRO engine
runs ZeRO 1-3 (ms_llm.mindspore.support decides which). Every rank builds the same model from
the seed and reads its rows of the shared global batch.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from ms_llm.errors import MsLlmError, TrainingDiverged
from ms_llm.job import JobConfig, load_job
from ms_llm.machine import Machine
from ms_llm.nodes import exit_with_supervisor, wait_for_gate
from ms_llm.run import RunFolder
from ms_llm.run.loop import DIVERGED_EXIT
from ms_llm.strategy.plan import ModelPlan

DTYPES = ("float32", "float16", "bfloat16")


def logging_rank(p: ModelPlan) -> int:
    """The first rank of the last pipeline stage: it holds the loss."""
    return p.mesh.rank(pp=p.strategy.pp - 1)


def build_graph_step(job: JobConfig, p: ModelPlan, run: RunFolder, rank: int, world: int, ascend: bool):
    """The compiled step: lowered to semi_auto_parallel on Ascend, stand-alone / DATA_PARALLEL elsewhere."""
    import mindspore as ms
    from mindspore import nn

    from ms_llm.mindspore.collectives import BroadcastParams, MeanOverRanks
    from ms_llm.mindspore.lower import lower, ring_attention
    from ms_llm.mindspore.model import LossCell, RMSNorm, Transformer
    from ms_llm.mindspore.moe import ExpertBiasUpdate, Router
    from ms_llm.mindspore.optim import AdamW
    from ms_llm.mindspore.step import EvalCell, GraphStep, TrainCell
    from ms_llm.run.loss_scale import LossScaler

    net = Transformer(job.model, ring_attention=ascend and ring_attention(p))
    net.init_weights(job.train.seed)
    loss_cell = LossCell(net, loads=job.model.moe is not None and job.model.moe.expert_bias)
    if ascend:
        from ms_llm.mindspore.apply import apply_lowering, set_context

        low = lower(p, strategy_file=str(run.root / "strategy" / f"ckpt_strategy_rank_{rank}.ckpt"))
        set_context(low)
        apply_lowering(loss_cell, low)
    elif world > 1:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
    compute = getattr(ms, p.strategy.precision.compute_dtype)
    if compute != ms.float32:
        net.to_float(compute)
        for _, cell in net.cells_and_names():          # norms in fp32, as MindFormers computes them (an fp16
            if isinstance(cell, (RMSNorm, Router)):    # rsqrt backward gives NaN gradients on CPU); routers too
                cell.to_float(ms.float32)
        loss_cell.loss.to_float(ms.float32)            # softmax cross-entropy in fp32
    params = loss_cell.trainable_params()
    reducer = mean = None
    if world > 1 and not ascend:                       # semi_auto_parallel reduces inside the graph
        BroadcastParams(params)().asnumpy()
        reducer = nn.DistributedGradReducer(params, mean=True, degree=world)
        mean = MeanOverRanks(world)
    pipeline = p.strategy.pp > 1
    body = nn.PipelineCell(loss_cell, micro_size=p.micro_batches) if pipeline else loss_cell
    # The expert biases move after each update, by the loads summed over the CPU data-parallel ranks.
    bias_update = (ExpertBiasUpdate(net.expert_biases(), job.model.moe.bias_update_rate, world if reducer else 1)
                   if loss_cell.with_loads else None)
    cell = TrainCell(body, AdamW(params, job.train.optimizer), p.micro_batches, job.train.optimizer.grad_clip,
                     reducer, mean, pipeline, bias_update)
    # Validation is cross-entropy alone; MoE has no lowering, so its body is never a PipelineCell.
    eval_body = LossCell(net, training=False) if job.model.moe is not None or job.model.mtp_layers else body
    evaluator = EvalCell(eval_body, p.micro_batches, mean, pipeline)
    return GraphStep(cell, evaluator, job, p, LossScaler.from_precision(p.strategy.precision))


def compile_cache_folder(ascend: bool) -> Optional[Path]:
    """The folder for MindSpore's compile cache (the launcher's, keyed by job, world and code),
    None to compile afresh: MS_COMPILER_CACHE_ENABLE=0 turns it off; not yet checked on Ascend."""
    from ms_llm.mindspore.compile_cache import RUN_ENV

    if ascend or os.environ.get("MS_COMPILER_CACHE_ENABLE") == "0" or RUN_ENV not in os.environ:
        return None
    return Path(os.environ[RUN_ENV])


def build_trainer(run: RunFolder, job: JobConfig, machine: Machine):
    import mindspore as ms

    from ms_llm.mindspore.state import MsTrainerState
    from ms_llm.mindspore.support import zero_engine
    from ms_llm.run import peak_rss_gb
    from ms_llm.run.loop import Trainer
    from ms_llm.run.metrics import max_expert_load
    from ms_llm.strategy.plan import plan as make_plan

    ascend = machine.accelerator == "ascend"
    ms.set_context(device_target="Ascend" if ascend else "CPU")
    rank, world = 0, 1
    if "MS_WORKER_NUM" in os.environ:                  # started by msrun
        from mindspore.communication import get_group_size, get_rank, init
        init()
        rank, world = get_rank(), get_group_size()
    p = make_plan(job.model, job.strategy, job.train, world)         # checks the world size too
    shared_zero = zero_engine(p, machine) == "shared"
    ms.set_context(mode=ms.PYNATIVE_MODE if shared_zero else ms.GRAPH_MODE)
    if shared_zero:
        from ms_llm.mindspore.model import LossCell, Transformer
        from ms_llm.mindspore.step import ZeroStep

        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
        net = Transformer(job.model)
        net.init_weights(job.train.seed)
        step_fn = ZeroStep(net, LossCell(net), job, p, rank, world)
        mode, loss_scale = "DATA_PARALLEL, PyNative + shared ZeRO engine", None
    else:
        # MindSpore's cache names graphs by their order of compilation: only the start-up ones
        # (parameter broadcast, the step) come in a fixed order; later ones (the checkpoint
        # agreements' one gather, state.agreement_row) compile afresh.
        from ms_llm.mindspore.compile_cache import fetch, publish

        cache = compile_cache_folder(ascend)
        if cache is not None:
            fetch(cache, rank)
            os.environ["MS_COMPILER_CACHE_PATH"] = str(cache)
            ms.set_context(enable_compile_cache=True)
        step_fn = build_graph_step(job, p, run, rank, world, ascend)
        step_fn.compile()
        ms.set_context(enable_compile_cache=False)
        if cache is not None:
            publish(cache, rank)
        mode = "semi_auto_parallel" if ascend else "DATA_PARALLEL, GRAPH" if world > 1 else "stand-alone, GRAPH"
        loss_scale = step_fn.loss_scale

    def memory_gb() -> float:
        return ms.runtime.max_memory_allocated() / 2**30 if ascend else peak_rss_gb()

    logs = rank == logging_rank(p)
    if logs:
        print(f"MindSpore {mode}: {p.mesh.describe()} | ZeRO {p.zero.stage} | {p.micro_batches} micro-batch(es) | "
              f"precision {p.strategy.precision.compute_dtype}", flush=True)
    def reported() -> dict[str, float]:
        return {} if step_fn.loads is None else {"max_expert_load": max_expert_load(step_fn.loads)}

    return Trainer(job, run, p, rank, step_fn, MsTrainerState(step_fn, p, rank, world), memory_gb, logs, loss_scale,
                   step_fn.evaluate, reported)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ms_llm.mindspore.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="run folder written by `ms-llm train` (holds config.yaml)")
    run = RunFolder(Path(ap.parse_args(argv).run_dir).resolve())
    exit_with_supervisor()
    import mindspore  # noqa: F401  (a standby worker imports everything before its gate)

    import ms_llm.mindspore.step  # noqa: F401
    from ms_llm.run.loop import train

    if not wait_for_gate():
        return 0
    try:
        job = load_job(run.config)
        trainer = build_trainer(run, job, Machine.detect())
        train(trainer)
    except TrainingDiverged as exc:
        print(f"ms_llm.mindspore.worker: {exc}", file=sys.stderr, flush=True)
        return DIVERGED_EXIT
    except MsLlmError as exc:
        print(f"ms_llm.mindspore.worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
