"""MindFormers training YAML -> IR (mindformers_yaml.py writes it back), in its three layouts:
r1.x (LlamaConfig keys; MindFormers 2.x still builds these with use_legacy: True), 2.x
(use_legacy: False, Hugging Face model keys: mindformers_model.py) and the pynative trainer's
(training / parallelism sections: mindformers_pynative.py).

Degrees come from `parallel_config` (dp * mp * cp * pp is the device count, as MindFormers
requires in semi_auto_parallel); ZeRO from `parallel.enable_parallel_optimizer` with MindSpore's
`parallel_optimizer_config.optimizer_level` (level1/2/3 = stage 1/2/3; gradient_accumulation_shard
is the older spelling of level2); recompute from `recompute_config`; the model from
`model.model_config`; the data from the Megatron dataset section (mindformers_data.py). The
global batch follows MindFormers' base_trainer rule: batch_size * dp * micro_batch_num *
micro_batch_interleave_num with pipeline stages, batch_size * dp * interleave *
gradient_accumulation_steps without. use_seq_parallel is sequence_parallel with context parallel
as well (MindFormers' LLaMA then splits the residual stream over cp*mp).
"""
from __future__ import annotations

import math
from pathlib import Path

from ms_llm.convert.common import ConversionError, Converted, Fields, ReadOptions, make_job
from ms_llm.convert.mindformers import pynative as mindformers_pynative
from ms_llm.convert.mindformers.data import read_data
from ms_llm.convert.mindformers.model import MC, MCORE, Layout, layout_of, mindformers_ffn, read_dtypes, read_model
from ms_llm.convert.mindformers.moe import legacy_section
from ms_llm.convert.mindformers.train import OPTIMIZERS, read_schedule
from ms_llm.job import parse_yaml

__all__ = ["read", "mindformers_ffn"]

PARALLEL_MODES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel"}
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "zero_bubble_v": "zbv", "seqpipe": "1f1b", "seqvpp": "1f1b",
             "seqsmartvpp": "1f1b"}
OPTIMIZER_LEVELS = {"level1": 1, "level2": 2, "level3": 3}
# context_parallel_algo -> strategy.context_parallel.algorithm (hybrid_cp has no IR name: _cp_algorithm).
CP_ALGOS = {"colossalai_cp": "allgather", "ulysses_cp": "ulysses", "hybrid_cp": None}
CHECKPOINT_CALLBACKS = ("CheckpointMonitor", "CheckpointMointor")   # the second is MindFormers' historical alias
BIAS_CALLBACK = "TopkBiasBalanceCallback"          # moves the expert bias: model.moe.bias_update_rate (_bias_callback)
DEVICES = {"Ascend": "910b", "GPU": "h100", "CPU": "cpu"}
# Keys whose usual values say nothing the IR models (how MindSpore runs, not how work is split).
NEUTRAL = {"use_parallel": (True,), "run_mode": ("train",), "parallel.gradients_mean": (False,),
           "parallel.enable_alltoall": (False, True), "parallel.full_batch": (True, False),
           "parallel.search_mode": ("sharding_propagation", "recursive_programming", "dynamic_programming"),
           "context.mode": (0,), "runner_config.sink_mode": (True,), "runner_config.sink_size": (1,),
           "micro_batch_interleave_num": (1,), "parallel_config.vocab_emb_dp": (False,),
           "trainer.type": ("CausalLanguageModelingTrainer",), "model.arch.type": ("LlamaForCausalLM",),
           "runner_wrapper.type": ("MFTrainOneStepCell",), "do_eval": (False,),
           "use_legacy": (True, False),
           "train_dataset.data_loader.datasets_type": ("GPTDataset",), "train_dataset_task.type":
           ("CausalLanguageModelDataset",)}


def read(text: str, source: str, options: ReadOptions) -> Converted:
    data = parse_yaml(text, source)
    if not isinstance(data, dict):
        raise ConversionError(f"{source}: expected a MindFormers YAML mapping (parallel_config, model, ...)")
    if mindformers_pynative.is_pynative(data):
        return mindformers_pynative.read(data, source, options)
    f = Fields(data, source)
    warnings: list[str] = []
    f.accept_usual(NEUTRAL)
    layout = layout_of(f)
    pc = "parallel_config"
    dp = f.get(f"{pc}.data_parallel", int, 1, ir="strategy.dp")
    tp = f.get(f"{pc}.model_parallel", int, 1, ir="strategy.tp")
    cp = f.get(f"{pc}.context_parallel", int, 1, ir="strategy.cp")
    pp = f.get(f"{pc}.pipeline_stage", int, 1, ir="strategy.pp")
    ep = f.get(f"{pc}.expert_parallel", int, 1, ir="strategy.ep")
    world = dp * tp * cp * pp
    if options.world_size and options.world_size != world:
        raise ConversionError(f"{source}: parallel_config gives data_parallel*model_parallel*context_parallel*"
                              f"pipeline_stage = {dp}*{tp}*{cp}*{pp} = {world} devices, not --world-size "
                              f"{options.world_size} (MindFormers needs the product to equal the device count); "
                              "change the degrees or drop --world-size")
    _check_mode(f, tp, pp, warnings)
    sp = f.get(f"{pc}.use_seq_parallel", bool, False, ir="strategy.sequence_parallel")
    if sp and tp == 1:
        warnings.append(f"{pc}.use_seq_parallel is a no-op in MindFormers when model_parallel = 1; off")
        sp = False
    if f.raw(f"{pc}.vocab_emb_dp", False) is True and tp > 1 and pp == 1:
        warnings.append(f"{pc}.vocab_emb_dp: a replicated embedding is not modelled; ms_llm splits the vocabulary "
                        "over model_parallel")
    model = read_model(f, layout, warnings, given=options.model)
    _bias_callback(f, model, warnings)
    algorithm = _cp_algorithm(f, cp, warnings)
    if cp > 1 and not model["flash_attention"]:
        raise f.error(f"{pc}.context_parallel", f"needs {MC}.use_flash_attention: True (MindFormers refuses "
                                                 "context parallel without it)")
    ep, etp = _expert_parallel(f, layout, ep, (dp, cp, tp), (model["moe"] or {}).get("num_experts", 0), warnings)
    precision = _precision(f, layout, warnings)
    model["dtype"] = precision["param_dtype"]
    strategy = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "sequence_parallel": sp,
                "context_parallel": {"algorithm": algorithm},
                "zero": _zero(f, dp, warnings), "pipeline": _pipeline(f, model["num_layers"], pp, warnings),
                "recompute": _recompute(f, warnings), "precision": precision}
    train = _train(f, dp, pp, warnings)
    device = options.device or DEVICES.get(f.get("context.device_target", str, "Ascend", ir="device"), "910b")
    name = f.get("trainer.model_name", str, Path(source).stem)
    model["name"] = name
    job = make_job(f, name=name, model=model, strategy=strategy, train=train, device=device, backend="mindspore")
    return Converted(job, world, warnings + f.unused(), f.sources)


def _bias_callback(f: Fields, model: dict, warnings: list[str]) -> None:
    """MindFormers moves the aux-loss-free expert bias in its TopkBiasBalanceCallback, after each
    step; without it the bias stays at zero."""
    callbacks = f.peek("callbacks", [])
    at = [i for i, cb in enumerate(callbacks if isinstance(callbacks, list) else [])
          if isinstance(cb, dict) and cb.get("type") == BIAS_CALLBACK]
    bias = (model.get("moe") or {}).get("expert_bias", False)
    if bias and not at and model["moe"].get("bias_update_rate"):
        warnings.append(f"{MC}.moe_router_enable_expert_bias: True without a {BIAS_CALLBACK} in callbacks: MindFormers "
                        "never moves the bias; read with model.moe.bias_update_rate 0")
        model["moe"]["bias_update_rate"] = 0.0
    if at and not bias:
        warnings.append(f"callbacks[{at[0]}] {BIAS_CALLBACK}: the model has no expert bias to move; dropped")


def _cp_algorithm(f: Fields, cp: int, warnings: list[str]) -> str:
    """context_parallel_algo (colossalai_cp: K/V all-gathered; ulysses_cp: all-to-all over heads) and
    model_config.use_ring_attention (colossalai_cp's sharding with K/V passed around a ring)."""
    algo = f.get("parallel_config.context_parallel_algo", tuple(CP_ALGOS), "colossalai_cp",
                 ir="strategy.context_parallel.algorithm")
    ring = f.get(f"{MC}.use_ring_attention", bool, False, ir="strategy.context_parallel.algorithm")
    if cp == 1:
        return "auto"
    if ring and algo != "colossalai_cp":
        raise f.error(f"{MC}.use_ring_attention", f"ring attention runs with context_parallel_algo colossalai_cp, "
                                                  f"not {algo}; keep one of them")
    if algo == "hybrid_cp":
        warnings.append("parallel_config.context_parallel_algo = hybrid_cp (Ulysses inside ulysses_degree_in_cp, "
                        "K/V all-gathered across) has no ms_llm equivalent; read as allgather over the whole cp group")
        return "allgather"
    return "ring" if ring else CP_ALGOS[algo]


def _expert_parallel(f: Fields, layout: Layout, ep: int, degrees: tuple[int, int, int], experts: int,
                     warnings: list[str]) -> tuple[int, int]:
    """(ep, etp): MindFormers folds the experts over a stage's dp*cp*mp ranks as the IR does (edp x ep x
    etp, ms_llm/strategy/mesh.py). r1.x's MoE (MoEV2) splits each expert's width over
    moe_config.expert_model_parallel, 1 or model_parallel (unset: model_parallel, the IR's etp -1), and
    carves ep out of dp*cp*mp / that. 2.x trains grouped-GEMM experts only (FFNGroupedGEMM), whole on
    every rank with ep innermost over (dp*mp*cp/ep, ep): etp 1, whatever parallel_config.
    expert_model_parallel (its expert_tensor_parallel_size, which only the unused batched experts read)
    says. An ep that does not fold is named and read as the largest degree that does."""
    dp, cp, tp = degrees
    if layout is MCORE:
        key = "parallel_config.expert_model_parallel"
        given = f.get(key, int, None, ir="strategy.etp")
        if experts and given not in (None, 1):
            warnings.append(f"{key} = {given}: MindFormers 2.1's grouped-GEMM experts are whole on every rank (its "
                            "expert_tensor_parallel_size is read by no expert layer it trains); read as etp = 1")
        etp = 1 if experts else -1
    else:
        key = f"{legacy_section(f, MC)}.expert_model_parallel"
        etp = f.get(key, int, -1, ir="strategy.etp")
        if etp not in (-1, 1, tp):
            raise f.error(key, f"got {etp}; MindFormers takes 1 or model_parallel = {tp} (its MoE refuses others)")
    if not experts:
        if ep != 1:
            warnings.append(f"parallel_config.expert_parallel = {ep}: the model has no experts; read as 1")
        return 1, -1
    ranks = dp * cp * tp // (tp if etp == -1 else etp)
    fit = math.gcd(math.gcd(ep, ranks), experts)
    if fit != ep:
        warnings.append(f"parallel_config.expert_parallel = {ep}: the experts fold over dp*cp*mp / expert tensor "
                        f"parallel = {ranks} ranks and {experts} experts; read as ep = {fit}")
    return fit, etp


def _check_mode(f: Fields, tp: int, pp: int, warnings: list[str]) -> None:
    mode = f.raw("parallel.parallel_mode", 1)
    name = PARALLEL_MODES.get(mode, mode) if isinstance(mode, int) else str(mode).lower()
    if name not in PARALLEL_MODES.values():
        raise f.error("parallel.parallel_mode", f"got {mode!r}; expected 0-3 or "
                                                f"{', '.join(PARALLEL_MODES.values())}")
    if name == "data_parallel" and (tp > 1 or pp > 1):
        raise f.error("parallel.parallel_mode", "data_parallel (0) cannot run model_parallel or pipeline_stage > 1; "
                                                "use semi_auto_parallel (1)")
    if name == "data_parallel" and f.raw("parallel.full_batch", False) is True:
        raise f.error("parallel.full_batch", "must be False in data_parallel mode (each rank reads its own batch)")
    if name in ("auto_parallel", "hybrid_parallel"):
        warnings.append(f"parallel.parallel_mode = {name}: MindSpore picks the operator strategies; the "
                        "parallel_config degrees are used as given")


def _precision(f: Fields, layout: Layout, warnings: list[str]) -> dict:
    compute, stored = read_dtypes(f, layout)
    if stored == "float32" and compute != "float32":
        prec = {"param_dtype": compute, "compute_dtype": compute, "master_dtype": "float32",
                "grad_reduce_dtype": "float32"}
    else:
        prec = {"param_dtype": stored, "compute_dtype": compute, "master_dtype": stored, "grad_reduce_dtype": stored}
    prec.update(read_loss_scale(f, warnings))
    return prec


def read_loss_scale(f: Fields, warnings: list[str]) -> dict:
    """runner_wrapper.scale_sense: 1.0 (none), a number (static) or a loss-scale cell."""
    sense = f.raw("runner_wrapper.scale_sense", 1.0, ir="strategy.precision.loss_scale")
    if isinstance(sense, dict):
        kind = f.get("runner_wrapper.scale_sense.type", ("DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell"))
        value = f.get("runner_wrapper.scale_sense.loss_scale_value", float, 65536.0,
                      ir="strategy.precision.initial_loss_scale")
        for key, usual in (("scale_factor", 2), ("scale_window", 1000)):
            value_ = f.raw(f"runner_wrapper.scale_sense.{key}", usual)
            if value_ != usual:
                warnings.append(f"runner_wrapper.scale_sense.{key} = {value_}: the loss-scale update rule is not "
                                f"modelled ({usual} assumed)")
        return {"loss_scale": "dynamic" if kind.startswith("Dynamic") else "static", "initial_loss_scale": value}
    if isinstance(sense, (int, float)) and not isinstance(sense, bool):
        return {"loss_scale": "static", "initial_loss_scale": float(sense)} if sense != 1.0 else {}
    raise f.error("runner_wrapper.scale_sense", f"got {sense!r}; expected a number or a loss-scale cell mapping")


def _zero(f: Fields, dp: int, warnings: list[str]) -> dict:
    on = f.get("parallel.enable_parallel_optimizer", bool, False, ir="strategy.zero.stage")
    if f.raw("parallel_config.optimizer_shard") is True:
        warnings.append("parallel_config.optimizer_shard is deprecated; read as parallel.enable_parallel_optimizer")
        on = True
    if not on:
        return {}
    poc = "parallel.parallel_optimizer_config"
    level = f.get(f"{poc}.optimizer_level", tuple(OPTIMIZER_LEVELS), "level1", ir="strategy.zero.stage")
    shard = f.get(f"{poc}.gradient_accumulation_shard", bool, False, ir="strategy.zero.stage")
    if shard and f.has(f"{poc}.optimizer_level") and level != "level2":
        raise f.error(f"{poc}.gradient_accumulation_shard", f"True needs optimizer_level level2, not {level} "
                                                            "(MindSpore refuses the pair); drop one of them")
    zero = {"stage": 2 if shard else OPTIMIZER_LEVELS[level]}
    size = f.get(f"{poc}.optimizer_weight_shard_size", int, -1, ir="strategy.zero.shard_size")
    if size > 0 and dp % size:
        warnings.append(f"{poc}.optimizer_weight_shard_size = {size} does not divide data_parallel = {dp}: MindSpore "
                        "then shards over the whole data-parallel group, and so does this conversion")
    elif size > 0:
        zero["shard_size"] = size
    return zero


def _pipeline(f: Fields, layers: int, pp: int, warnings: list[str]) -> dict:
    pc, mc = "parallel.pipeline_config", MC
    vpp = f.get(f"{mc}.pp_interleave_num", int, 1, ir="strategy.pipeline.virtual_stages")
    interleave = f.get(f"{pc}.pipeline_interleave", bool, False, ir="strategy.pipeline.schedule")
    scheduler = f.get(f"{pc}.pipeline_scheduler", tuple(SCHEDULES), "1f1b", ir="strategy.pipeline.schedule")
    if scheduler.startswith("seq"):
        warnings.append(f"{pc}.pipeline_scheduler = {scheduler}: sequence-chunked pipelining is not modelled; "
                        "1F1B over whole sequences")
    if vpp > 1 and not interleave:
        warnings.append(f"{mc}.pp_interleave_num = {vpp} without {pc}.pipeline_interleave: MindFormers runs one "
                        "chunk per stage")
        vpp = 1
    schedule = SCHEDULES[scheduler]
    if schedule == "1f1b" and vpp > 1:
        schedule = "interleaved_1f1b"
    pipe: dict = {"schedule": schedule, "virtual_stages": vpp}
    offset = f.raw(f"{mc}.offset", 0, ir="strategy.pipeline.layer_split")
    chunks = pp * vpp
    if offset in (0, None) and pp > 1 and layers % chunks:
        raise f.error(f"{mc}.offset", f"0, but {layers} layers over {chunks} pipeline chunks leave {layers % chunks}; "
                      f"give one offset per stage summing to {layers % chunks} (MindFormers refuses it too)")
    if offset not in (0, None) and pp > 1:
        flat = [o for chunk in offset for o in chunk] if isinstance(offset, list) and offset and \
            isinstance(offset[0], list) else offset
        if not isinstance(flat, list) or len(flat) != chunks or not all(isinstance(o, int) for o in flat):
            raise f.error(f"{mc}.offset", f"got {offset!r}; expected 0, or {pp} integers (one per stage)"
                                          + (f" per interleave chunk ({vpp} lists)" if vpp > 1 else ""))
        base = layers // chunks
        pipe["layer_split"] = [base + o for o in flat]
    if pp == 1 and f.raw("parallel_config.micro_batch_num", 1) != 1:
        warnings.append("parallel_config.micro_batch_num is ignored without pipeline stages, as MindFormers does")
    return pipe


def _recompute(f: Fields, warnings: list[str]) -> dict:
    rc = "recompute_config"
    full = f.raw(f"{rc}.recompute", False, ir="strategy.recompute.policy")
    select = f.raw(f"{rc}.select_recompute", False, ir="strategy.recompute.policy")
    if full not in (False, None, 0, []):
        if full is True:
            return {"policy": "full"}
        counts = [c for item in full for c in (item if isinstance(item, list) else [item])] \
            if isinstance(full, list) else None
        if not counts or not all(isinstance(c, int) for c in counts):
            raise f.error(f"{rc}.recompute", f"got {full!r}; expected true/false or layer counts per stage")
        if len(set(counts)) > 1:
            warnings.append(f"{rc}.recompute = {full}: per-stage counts differ; the first {max(counts)} layers of "
                            "every stage are recomputed")
        return {"policy": "full", "num_layers": max(counts)}
    if select not in (False, None, [], {}):
        if not (select is True):
            warnings.append(f"{rc}.select_recompute = {select!r}: read as ms_llm's selective policy (attention core "
                            "and MLP activation of every layer)")
        return {"policy": "selective"}
    return {}


def _train(f: Fields, dp: int, pp: int, warnings: list[str]) -> dict:
    batch = f.get("runner_config.batch_size", int, 1, ir="train.micro_batch_size")
    interleave = f.get("micro_batch_interleave_num", int, 1)
    if interleave > 1:
        warnings.append(f"micro_batch_interleave_num = {interleave}: read as a micro batch of batch_size * "
                        f"{interleave} = {batch * interleave} (MindFormers splits it to overlap communication)")
    gas = f.get("runner_config.gradient_accumulation_steps", int, 1, ir="strategy.pipeline.micro_batches")
    if pp > 1:
        micro = f.get("parallel_config.micro_batch_num", int, 1, ir="strategy.pipeline.micro_batches")
        if gas > 1:
            warnings.append(f"runner_config.gradient_accumulation_steps = {gas} is ignored under pipeline "
                            "parallel, as MindFormers does")
    else:
        micro = gas
    f.sources["train.global_batch_size"] = "runner_config.batch_size"
    gbs = batch * dp * micro * interleave
    train: dict = {"micro_batch_size": batch * interleave, "global_batch_size": gbs,
                   "seq_len": f.get(f"{MC}.seq_length", int, 4096), "seed": f.get("seed", int, 1234, ir="train.seed")}
    train["data"], samples = read_data(f, "train_dataset.data_loader", train["seq_len"], warnings)
    epochs = f.get("runner_config.epochs", int, 1, ir="train.steps")
    train["optimizer"], lr = _optimizer(f, warnings)
    train["schedule"], steps, lr = read_schedule(f, "lr_schedule", lr, epochs * (samples // gbs), warnings)
    train["optimizer"]["lr"] = lr
    if steps:
        train["steps"] = steps
    else:
        warnings.append("train.steps: MindFormers runs epochs over the dataset (lr_schedule.total_steps = -1) and "
                        "the dataset size is not in this file; ms_llm's default step count is used")
    train["checkpoint"], log_every = _callbacks(f, warnings)
    if log_every:
        train["log_every"] = log_every
    load = f.get("load_checkpoint", str, "")
    if load:
        train["checkpoint"]["load"] = load
    return train


def _optimizer(f: Fields, warnings: list[str]) -> tuple[dict, float]:
    clip = f.get("runner_wrapper.use_clip_grad", bool, False, ir="train.optimizer.grad_clip")
    # weight_decay_1d: MindFormers' parameter groups (get_optimizer_grouped_parameters) exempt 1-D
    # parameters (norm weights) and biases whatever the optimizer section says.
    opt: dict = {"grad_clip": f.get("runner_wrapper.max_grad_norm", float, 1.0, ir="train.optimizer.grad_clip")
                 if clip else 0.0, "weight_decay_1d": False}
    if not f.has("optimizer"):
        return opt, None
    kind = f.get("optimizer.type", str, "AdamW", ir="train.optimizer.name")
    if kind not in OPTIMIZERS:
        warnings.append(f"optimizer.type = {kind}: read as AdamW")
    if f.has("optimizer.betas"):
        betas = f.get("optimizer.betas", list, ir="train.optimizer.beta1")
        if len(betas) != 2:
            raise f.error("optimizer.betas", f"got {betas!r}; expected [beta1, beta2]")
        b1, b2 = (float(b) for b in betas)
    else:
        b1 = f.get("optimizer.beta1", float, 0.9, ir="train.optimizer.beta1")
        b2 = f.get("optimizer.beta2", float, 0.999, ir="train.optimizer.beta2")
    opt.update(name="adamw", beta1=b1, beta2=b2, eps=f.get("optimizer.eps", float, 1e-8, ir="train.optimizer.eps"),
               weight_decay=f.get("optimizer.weight_decay", float, 0.0, ir="train.optimizer.weight_decay"))
    return opt, f.get("optimizer.learning_rate", float, None, ir="train.optimizer.lr")


def _callbacks(f: Fields, warnings: list[str]) -> tuple[dict, int]:
    callbacks = f.raw("callbacks", [])
    checkpoint: dict = {"interval": 0}
    log_every = 0
    if not isinstance(callbacks, list):
        raise f.error("callbacks", f"got {callbacks!r}; expected a list of {{type: ...}} mappings")
    for i, cb in enumerate(callbacks):
        kind = cb.get("type") if isinstance(cb, dict) else None
        if kind in CHECKPOINT_CALLBACKS:
            checkpoint["interval"] = int(cb.get("save_checkpoint_steps", 1))
            checkpoint["async_save"] = bool(cb.get("async_save", False))
            if "keep_checkpoint_max" in cb:
                checkpoint["keep_last"] = int(cb["keep_checkpoint_max"])
            f.sources["train.checkpoint.interval"] = f"callbacks[{i}].save_checkpoint_steps"
            extra = sorted(set(cb) - {"type", "save_checkpoint_steps", "async_save", "keep_checkpoint_max"})
            if extra:
                warnings.append(f"callbacks[{i}] {kind}: {', '.join(extra)} not modelled; dropped")
        elif kind == "MFLossMonitor":
            log_every = int(cb.get("per_print_times", 1))
        elif kind == BIAS_CALLBACK:         # its other keys restate model_config's for r1.x models (_bias_callback)
            continue
        else:
            warnings.append(f"callbacks[{i}] = {cb!r}: not modelled by ms_llm; dropped")
    return checkpoint, log_every
