"""IR -> a MindFormers pretrain YAML, which mindformers.read reads back to the same IR, in either
layout: r1.x (configs/llama2/pretrain_*.yaml: LlamaConfig keys, LlamaForCausalLM, which
MindFormers 2.x still builds with use_legacy: True) or 2.x (use_legacy: False, Hugging Face
model keys). MindFormers 2.x has no mcore LLaMA: its dense mcore model with configurable q/k norm
and biases is TeleChat3ForCausalLM, which with qk_layernorm and add_bias_linear off is LLaMA's
math (RMSNorm, SwiGLU, rotary, GQA), so a 2.x YAML
names it (attention_bias: MindFormers maps it to add_qkv_bias, q/k/v only); a model with
q/k norms names Qwen3ForCausalLM. r1.x holds q/k/v biases
(qkv_has_bias) and rope scaling (extend_method), not q/k norms or a head_dim of its own. Megatron datasets
(train.data.paths) become a BlendedMegatronDatasetDataLoader section; tokenizer and evaluation
sections are left to the user."""
from __future__ import annotations

import math

from ms_llm.convert.common import Written, cp_algorithm
from ms_llm.convert.mindformers.data import write_data
from ms_llm.convert.mindformers.mla import m_scale, write_mla, write_mtp
from ms_llm.convert.mindformers.model import EXTEND_METHODS
from ms_llm.convert.mindformers.moe import write_legacy_moe, write_mcore_moe
from ms_llm.convert.mindformers.read import BIAS_CALLBACK
from ms_llm.convert.mindformers.train import LR_SCHEDULES
from ms_llm.job import JobConfig, dump_yaml

SCHEDULERS = {"1f1b": "1f1b", "interleaved_1f1b": "1f1b", "gpipe": "gpipe", "zbv": "zero_bubble_v"}
LR_TYPES = {decay: name for name, decay in LR_SCHEDULES.items()}
TARGETS = {"910b": "Ascend", "cpu": "CPU"}
# strategy.context_parallel.algorithm -> context_parallel_algo; ring is colossalai_cp's sharding with
# model_config.use_ring_attention (mindformers.read's _cp_algorithm reads both back).
CP_ALGOS = {"allgather": "colossalai_cp", "ulysses": "ulysses_cp", "ring": "colossalai_cp"}


def write(job: JobConfig, world_size: int, mcore: bool = False) -> Written:
    """The r1.x layout, or with `mcore` the 2.x one (mindformers2_yaml)."""
    m, s, t = job.model, job.strategy, job.train
    warnings: list[str] = []
    expressed = {"model", "strategy.dp", "strategy.tp", "strategy.pp", "strategy.cp", "strategy.ep", "strategy.etp",
                 "strategy.sequence_parallel", "strategy.pipeline", "strategy.zero.stage", "strategy.zero.shard_size",
                 "strategy.recompute", "strategy.precision", "train.global_batch_size", "train.micro_batch_size",
                 "train.seq_len", "train.steps", "train.seed", "train.log_every", "train.optimizer", "train.schedule",
                 "train.checkpoint.interval", "train.checkpoint.load", "strategy.context_parallel"}
    if t.checkpoint.interval:
        expressed |= {"train.checkpoint.async_save", "train.checkpoint.keep_last"}     # on the CheckpointMonitor
    micro = t.global_batch_size // (t.micro_batch_size * s.dp)
    parallel: dict = {"parallel_mode": 1, "gradients_mean": False, "enable_alltoall": s.ep > 1, "full_batch": True,
                      "search_mode": "sharding_propagation", "enable_parallel_optimizer": s.zero.stage > 0}
    if s.zero.stage:
        # MindSpore's optimizer_level: level1 / level2 / level3 = ZeRO stage 1 / 2 / 3 (mindformers.read maps back)
        poc: dict = {"optimizer_level": f"level{s.zero.stage}"}
        if s.zero.shard_size not in (-1, s.dp):
            poc["optimizer_weight_shard_size"] = s.zero.shard_size
        parallel["parallel_optimizer_config"] = poc
    pipe = s.pipeline
    if s.pp > 1:
        parallel["pipeline_config"] = {"pipeline_interleave": pipe.virtual_stages > 1,
                                       "pipeline_scheduler": SCHEDULERS.get(pipe.schedule, "1f1b")}
        if pipe.schedule == "zero_bubble":
            warnings.append("strategy.pipeline.schedule = zero_bubble: MindFormers has zero_bubble_v (ZBV) only; "
                            "1f1b written")
    parallel_config = {"data_parallel": s.dp, "model_parallel": s.tp, "context_parallel": s.cp,
                       "pipeline_stage": s.pp, "expert_parallel": s.ep, "use_seq_parallel": s.sequence_parallel,
                       "micro_batch_num": micro if s.pp > 1 else 1, "vocab_emb_dp": False}
    if mcore:
        _mcore_expert_tp(m, s, warnings)
    algorithm = cp_algorithm(job, "MindFormers' context_parallel_algo", warnings)
    if algorithm in ("ulysses", "allgather"):
        parallel_config["context_parallel_algo"] = CP_ALGOS[algorithm]
    out: dict = {"seed": t.seed, "load_checkpoint": t.checkpoint.load, "run_mode": "train",
                 "trainer": {"type": "CausalLanguageModelingTrainer", "model_name": m.name},
                 "runner_config": {"batch_size": t.micro_batch_size, "sink_mode": True, "sink_size": 1,
                                   "gradient_accumulation_steps": 1 if s.pp > 1 else micro},
                 "optimizer": {"type": "AdamW", "betas": [t.optimizer.beta1, t.optimizer.beta2], "eps": t.optimizer.eps,
                               "weight_decay": t.optimizer.weight_decay, "learning_rate": t.optimizer.lr},
                 "lr_schedule": {"type": LR_TYPES[t.schedule.decay], "learning_rate": t.optimizer.lr,
                                 "lr_end": t.optimizer.lr * t.schedule.min_lr_ratio,
                                 "warmup_steps": t.schedule.warmup_steps, "total_steps": t.steps},
                 "use_parallel": True, "parallel": parallel, "parallel_config": parallel_config,
                 "micro_batch_interleave_num": 1,
                 "recompute_config": _recompute(s, warnings, mcore),
                 "callbacks": _callbacks(job, warnings, mcore),
                 "context": {"mode": 0, "device_target": TARGETS.get(job.device, "GPU")},
                 "model": {"model_config": _mcore_model_config(m, s, t, warnings)} if mcore else
                 {"model_config": _model_config(m, s, t, warnings), "arch": {"type": "LlamaForCausalLM"}},
                 "runner_wrapper": _wrapper(s, t)}
    if algorithm == "ring":
        out["model"]["model_config"]["use_ring_attention"] = True
    if mcore:
        out = {"use_legacy": False, **out}
    if t.data.paths:
        dataset = write_data(t.data, t.seq_len, t.steps * t.global_batch_size, t.seed)
        out["train_dataset"] = dataset          # the same mapping twice: YAML writes an anchor, as MindFormers does
        out["train_dataset_task"] = {"type": "CausalLanguageModelDataset", "dataset_config": dataset}
        expressed |= {"train.data.paths", "train.data.weights", "train.data.split"}
    if t.optimizer.name != "adamw":
        warnings.append(f"train.optimizer.name = {t.optimizer.name}: MindFormers pretraining uses AdamW; AdamW written")
    if t.schedule.warmup_steps and not t.schedule.warmup_from_zero:
        warnings.append("train.schedule.warmup_from_zero = false: MindFormers' warmup starts at 0 (update k runs at "
                        "lr*(k-1)/warmup_steps, not lr*k/warmup_steps); its warmup runs one update behind this job's")
    if t.optimizer.weight_decay_1d:
        warnings.append("train.optimizer.weight_decay_1d = true: MindFormers' parameter groups never decay biases "
                        "and 1-D parameters (norm weights); they will not decay")
    if s.offload.optimizer or s.offload.params:
        warnings.append("strategy.offload: MindFormers' swap_config moves activations, not optimizer states or "
                        "parameters; not written")
    if t.steps and not t.data.paths:
        warnings.append(f"train.steps = {t.steps}: MindFormers runs epochs over the dataset; the step count is "
                        "written as lr_schedule.total_steps only")
    header = (f"# {job.name}: {m.name} on {world_size} devices; MindFormers {'2.x' if mcore else 'r1.x'} layout, "
              "written by ms-llm convert-strategy.\n")
    return Written(header + dump_yaml(out), expressed, warnings)


def _stored_dtype(p, warnings: list[str]) -> str:
    """The one parameter dtype MindFormers holds: float32 under mixed precision, else the master's."""
    if p.master_dtype == "float32" and p.compute_dtype != "float32":
        if p.grad_reduce_dtype != "float32":
            warnings.append(f"strategy.precision.grad_reduce_dtype = {p.grad_reduce_dtype}: MindSpore reduces the "
                            "gradients of float32 parameters in float32")
        return "float32"
    if p.param_dtype != p.master_dtype or p.grad_reduce_dtype != p.master_dtype:
        warnings.append(f"strategy.precision: params {p.param_dtype}, master {p.master_dtype}, gradient reduce "
                        f"{p.grad_reduce_dtype}: MindFormers holds one parameter dtype ({p.master_dtype} written)")
    return p.master_dtype


def _mcore_model_config(m, s, t, warnings: list[str]) -> dict:
    """DeepseekV3ForCausalLM for multi-latent attention (its MoE and MTP with it), else
    Qwen3MoeForCausalLM for MoE, Qwen3ForCausalLM when the model normalizes q and k (MindFormers'
    Qwen3 always builds the norms), TeleChat3ForCausalLM otherwise; q/k/v biases are add_qkv_bias."""
    p = s.precision
    arch = ("qwen3", "Qwen3ForCausalLM") if m.qk_norm else ("telechat3", "TeleChat3ForCausalLM")
    if m.mla is not None:
        arch = ("deepseek_v3", "DeepseekV3ForCausalLM")
    elif m.moe is not None:
        arch = ("qwen3_moe", "Qwen3MoeForCausalLM")
        if not m.qk_norm:
            warnings.append("model.qk_norm = False: MindFormers 2.x's grouped-query MoE model, Qwen3MoeForCausalLM, "
                            "always builds q/k norms; written with them (the r1.x layout, --to mindformers, has none)")
    mc: dict = {"model_type": arch[0], "architectures": [arch[1]], "vocab_size": m.vocab_size,
                "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
                "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
                "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "swiglu",
                "max_position_embeddings": m.max_seq_len, "seq_length": t.seq_len, "rms_norm_eps": m.norm_eps,
                "tie_word_embeddings": m.tie_embeddings, "rope_theta": m.rope_theta, "position_embedding_type": "rope",
                "attention_bias": m.qkv_bias, "add_bias_linear": False,
                "qk_layernorm": m.qk_norm or arch[0] == "qwen3_moe",
                "use_flash_attention": m.flash_attention or s.cp > 1, "params_dtype": _stored_dtype(p, warnings),
                "compute_dtype": p.compute_dtype, **_pipeline_keys(m, s)}
    if m.mla is not None:
        del mc["head_dim"]                          # MLA's head widths are its own keys
        mc.update(write_mla(m, warnings))
        mc.update(write_mtp(m, warnings))
        mc.update(write_mcore_moe(m, "deepseek_v3", warnings) if m.moe is not None else
                  {"n_routed_experts": None, "n_shared_experts": 0})   # its class defaults DeepSeek-V3's experts
        return mc
    if m.rope_scaling.type != "default":
        warnings.append(f"model.rope_scaling.type = {m.rope_scaling.type}: MindFormers 2.x's training models build "
                        "plain rotary embeddings (GPTModel rope_scaling=False); not written, use the r1.x layout "
                        "(--to mindformers: extend_method)")
    if m.mtp_layers:
        warnings.append(f"model.mtp_layers = {m.mtp_layers}: MindFormers 2.1 builds multi-token prediction with "
                        "multi-latent attention only (DeepseekV3ForCausalLM); not written")
    if m.moe is not None:
        mc.update(write_mcore_moe(m, "qwen3_moe", warnings))
    return mc


def _mcore_expert_tp(m, s, warnings: list[str]) -> None:
    """MindFormers 2.1 trains whole experts (grouped GEMM, expert tensor parallel 1)."""
    if m.moe is not None and s.expert_tp != 1:
        warnings.append(f"strategy.etp = {s.expert_tp}: MindFormers 2.1's grouped-GEMM experts are whole on every "
                        f"rank (expert tensor parallel 1), ep {s.ep} folded over dp*cp*mp; not written")


def _pipeline_keys(m, s) -> dict:
    """offset (layers per stage beyond the even share) and pp_interleave_num, as LayerSetting reads them."""
    pipe = s.pipeline
    out: dict = {"pp_interleave_num": pipe.virtual_stages} if pipe.virtual_stages > 1 else {}
    if pipe.layer_split is None:
        return {**out, "offset": 0}
    base = m.num_layers // (s.pp * pipe.virtual_stages)
    offsets = [n - base for n in pipe.layer_split]
    offset = [offsets[v * s.pp:(v + 1) * s.pp] for v in range(pipe.virtual_stages)] \
        if pipe.virtual_stages > 1 else offsets
    return {**out, "offset": offset}


def _model_config(m, s, t, warnings: list[str]) -> dict:
    p = s.precision
    stored = _stored_dtype(p, warnings)
    mc: dict = {"type": "LlamaConfig", "seq_length": t.seq_len, "hidden_size": m.hidden_size,
                "num_layers": m.num_layers, "num_heads": m.num_heads, "n_kv_heads": m.num_kv_heads,
                "vocab_size": m.vocab_size, "intermediate_size": m.ffn_hidden_size, "rms_norm_eps": m.norm_eps,
                "theta": m.rope_theta, "max_position_embedding": m.max_seq_len,
                "tie_word_embeddings": m.tie_embeddings, "compute_dtype": p.compute_dtype,
                "param_init_type": stored, "use_flash_attention": m.flash_attention or s.cp > 1,
                "qkv_has_bias": m.qkv_bias}
    if s.cp > 1 and not m.flash_attention:
        warnings.append(f"model.flash_attention = False: MindFormers runs context parallel (strategy.cp = {s.cp}) "
                        "only with flash attention; use_flash_attention: True written")
    if m.moe is not None:
        mc["moe_config"] = write_legacy_moe(m, warnings)
        if s.expert_tp == 1 and s.tp > 1:          # MoEV2: experts whole, ep folded over mp too
            mc["moe_config"]["expert_model_parallel"] = 1
        elif s.expert_tp != s.tp:
            warnings.append(f"strategy.etp = {s.expert_tp}: r1.x's MoE splits an expert over 1 or model_parallel "
                            f"= {s.tp} ranks; not written (model_parallel applies)")
    mc.update(_legacy_rope(m, warnings))
    if m.head_dim * m.num_heads != m.hidden_size:
        warnings.append(f"model.head_dim = {m.head_dim}: r1.x's LlamaConfig derives it as hidden_size / num_heads "
                        f"= {m.hidden_size // m.num_heads}; use the 2.x layout (--to mindformers2)")
    if m.qk_norm:
        warnings.append("model.qk_norm: r1.x's LLaMA has no q/k norms; use the 2.x layout (--to mindformers2: "
                        "Qwen3ForCausalLM)")
    for field, value in (("mla", m.mla), ("mtp_layers", m.mtp_layers), ("mtp_loss_factor", m.mtp_layers)):
        if value:
            warnings.append(f"model.{field}: r1.x's LLaMA has no multi-latent attention or multi-token prediction; "
                            "use the 2.x layout (--to mindformers2: DeepseekV3ForCausalLM)")
    return {**mc, **_pipeline_keys(m, s)}


def _legacy_rope(m, warnings: list[str]) -> dict:
    """model.rope_scaling as r1.x FreqsMgr's extend_method + scaling_factor (mindformers_model.EXTEND_METHODS)."""
    r = m.rope_scaling
    if r.type == "default":
        return {}
    if r.type == "linear":
        return {"extend_method": "PI", "scaling_factor": r.factor}
    if r.type == "dynamic":
        warnings.append("model.rope_scaling.type = dynamic: MindFormers has no dynamic NTK (equal to plain rotary "
                        "within max_seq_len); not written")
        return {}
    values = {"factor": float(r.factor), "low_freq_factor": float(r.low_freq_factor),
              "high_freq_factor": float(r.high_freq_factor), "original_max_position_embeddings": r.original_max_seq_len,
              "beta_fast": float(r.beta_fast), "beta_slow": float(r.beta_slow)}
    if r.type == "yarn":
        # MindFormers scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim): mscale_all_dim 0
        # leaves the numerator, which mscale sets to the attention factor (default 0.1 ln(factor) + 1).
        ln = math.log(r.factor) if r.factor > 1 else 0.0
        attention = r.attention_factor if r.attention_factor is not None else \
            m_scale(r.factor, r.mscale) / m_scale(r.factor, r.mscale_all_dim) if r.mscale and r.mscale_all_dim else \
            0.1 * ln + 1.0
        if r.mscale_all_dim:
            warnings.append(f"model.rope_scaling.mscale_all_dim = {r.mscale_all_dim}: r1.x's LLaMA leaves the softmax "
                            "scale alone (DeepSeek's YaRN scales it); use the 2.x layout (--to mindformers2)")
        values.update(mscale=(attention - 1.0) / (0.1 * ln) if ln else 1.0, mscale_all_dim=0.0)
        if not r.truncate:
            warnings.append("model.rope_scaling.truncate = False: MindFormers rounds YaRN's ramp bounds; written as "
                            "True")
        if not ln and attention != 1.0:
            warnings.append(f"model.rope_scaling.attention_factor = {attention}: MindFormers derives 1 at factor 1; "
                            "not written")
    return {"extend_method": r.type.upper(),
            "scaling_factor": {k: values[k] for k in EXTEND_METHODS[r.type.upper()]}}


def _recompute(s, warnings: list[str], mcore: bool) -> dict:
    """Full recompute of the first N layers of each stage is a count per stage (per chunk and stage
    in 2.x, whose LayerSetting reads a (pp_interleave_num, pp) list)."""
    rc = s.recompute
    out = {"recompute": False, "select_recompute": False}
    if rc.policy == "full" and rc.num_layers != -1 and mcore:
        out["recompute"] = [[rc.num_layers] * s.pp for _ in range(s.pipeline.virtual_stages)]
    elif rc.policy == "full":
        out["recompute"] = True if rc.num_layers == -1 else [rc.num_layers] * s.pp
    elif rc.policy == "selective":
        out["select_recompute"] = True
        if rc.num_layers != -1:
            warnings.append(f"strategy.recompute.num_layers = {rc.num_layers}: written as selective recompute of "
                            "every layer")
    return out


def _callbacks(job: JobConfig, warnings: list[str], mcore: bool) -> list[dict]:
    ck = job.train.checkpoint
    out: list[dict] = [{"type": "MFLossMonitor", "per_print_times": job.train.log_every}]
    if ck.interval == "auto":
        warnings.append("train.checkpoint.interval = 'auto': MindFormers needs save_checkpoint_steps; none written")
    elif ck.interval:
        out.append({"type": "CheckpointMonitor", "save_checkpoint_steps": ck.interval,
                    "keep_checkpoint_max": ck.keep_last, "async_save": ck.async_save})
    moe = job.model.moe
    if mcore and moe is not None and moe.expert_bias and moe.bias_update_rate:
        out.append({"type": BIAS_CALLBACK})             # moves the expert bias after every step
    return out


def _wrapper(s, t) -> dict:
    p = s.precision
    out: dict = {"type": "MFTrainOneStepCell", "use_clip_grad": t.optimizer.grad_clip > 0}
    if t.optimizer.grad_clip:
        out["max_grad_norm"] = t.optimizer.grad_clip
    if p.loss_scale == "none":
        out["scale_sense"] = 1.0
    else:
        out["scale_sense"] = {"type": "DynamicLossScaleUpdateCell" if p.loss_scale == "dynamic"
                              else "FixedLossScaleUpdateCell", "loss_scale_value": p.initial_loss_scale}
        if p.loss_scale == "dynamic":
            out["scale_sense"].update(scale_factor=2, scale_window=1000)
    return out
