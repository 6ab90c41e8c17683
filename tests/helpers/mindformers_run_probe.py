"""MindFormers' side of tests/mindspore/test_import_mindformers.py: one process, PYTHONPATH=.oracles
(MindFormers 2.1.0), MindSpore on CPU in graph mode, one device (MindSpore does not compile
semi_auto_parallel on CPU).

The run is built from its YAML the way MindFormers' trainer builds it: build_context, the model
(LlamaForCausalLM from model.model_config), build_lr, get_optimizer_grouped_parameters, build_optim
(MindFormers' AdamW) and the runner_wrapper MFTrainOneStepCell (gradient clipping, loss scale), trained
by MindSpore's Model.train over the test's batches with MindFormers' CheckpointMonitor saving both of its
layouts (the YAML's callback, 1.x, and the same with use_legacy_format: False, 2.x). The trainer itself
wants a MindRecord dataset and a tokenizer. Two CPU adaptations: the YAML picks MindFormers' unfused
kernels (use_rope_slice, fused_rms_norm: False, no flash attention: the same math; the fused ones have no
CPU kernel), and the wrapper's overflow check runs MindSpore's IsFinite path (its Ascend INFNAN check)
because the status ops MindSpore uses on Ascend and GPU (NPUGetFloatStatusV2, FloatStatus) have no CPU
kernel.

argv[1]: JSON {"mode": "train" | "resume", "yaml": MindFormers YAML, "batches": .npy (steps, global batch,
seq + 1) of token ids, "out": JSON file, "save": folder (train), "load": an exported folder (resume)}.
  train: trains every batch; CheckpointMonitor saves <save>/legacy/checkpoint/rank_0/... and <save>/v2/.
  resume: finds and loads the checkpoint as MindFormers' resume does (get_resume_checkpoint,
          load_resume_checkpoint, ms.load_checkpoint + load_param_into_net) and trains from its step_num.
out: {"losses": {step: loss}, "step": the step it began from, "global_step": the optimizer's count then}.
With "then": a path, the process waits (at most peer_probe.WAIT_S) for that file: the next spec (the resume of what
the test exported from this run meanwhile), or {} to stop. One start of MindSpore and MindFormers serves
both.
"""
from __future__ import annotations

import json
import os
import sys

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore.nn.wrap import loss_scale

from mindformers import LlamaConfig, LlamaForCausalLM, MindFormerConfig
from mindformers.core import CheckpointMonitor, build_lr, build_optim
from mindformers.core.context import build_context
from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters
from mindformers.utils.resume_ckpt_utils import get_resume_checkpoint, load_resume_checkpoint
from mindformers.wrapper import MFTrainOneStepCell
from peer_probe import next_spec



class CpuTrainOneStepCell(MFTrainOneStepCell):
    """MFTrainOneStepCell whose overflow check is MindSpore's IsFinite one (see the module docstring)."""

    def get_overflow_status(self, status, compute_output):
        return self._get_distributed_overflow_status_on_infnan_mode(loss_scale._ascend_grad_overflow, compute_output)


def build(cfg: MindFormerConfig) -> CpuTrainOneStepCell:
    build_context(cfg)
    ms.set_seed(cfg.seed)
    model_config = {k: v for k, v in cfg.model.model_config.items() if k != "type"}
    net = LlamaForCausalLM(LlamaConfig(**model_config))
    lr = build_lr(cfg.lr_schedule)
    params = get_optimizer_grouped_parameters(net, cfg.optimizer.weight_decay, lr)
    optimizer = build_optim(cfg.optimizer, default_args={"params": params, "learning_rate": lr})
    wrapper = {k: v for k, v in cfg.runner_wrapper.items() if k != "type"}
    return CpuTrainOneStepCell(net, optimizer, **wrapper)


def train(cfg: MindFormerConfig, cell, batches: np.ndarray, save: str) -> dict:
    losses = {}

    class Record(ms.train.Callback):
        def on_train_step_end(self, run_context):
            params = run_context.original_args()
            losses[params.cur_step_num] = float(params.net_outputs[0].asnumpy().reshape(-1)[0])

    monitor = {k: v for k, v in next(c for c in cfg.callbacks if c["type"] == "CheckpointMonitor").items()
               if k != "type"}
    gbs = cfg.runner_config.batch_size * cfg.parallel_config.data_parallel
    monitors = [CheckpointMonitor(directory=f"{save}/legacy", global_batch_size=gbs, **monitor),
                CheckpointMonitor(directory=f"{save}/v2", global_batch_size=gbs, use_legacy_format=False, **monitor)]
    data = ds.GeneratorDataset(lambda: ((b,) for b in batches), ["input_ids"], shuffle=False)
    ms.Model(cell).train(1, data, callbacks=[Record(), *monitors], dataset_sink_mode=False)
    return {"losses": losses, "step": 0, "global_step": 0}


def resume(cell, batches: np.ndarray, load: str) -> dict:
    path = get_resume_checkpoint(load, True, "safetensors")
    step = int(load_resume_checkpoint(path, False, "safetensors")["step_num"])
    params = ms.load_checkpoint(path, format="safetensors")
    not_loaded, _ = ms.load_param_into_net(cell, params)
    if not_loaded:
        raise SystemExit(f"resume: {path} lacks {not_loaded}")
    global_step = int(cell.optimizer.global_step.asnumpy().reshape(-1)[0])
    losses = {}
    for i in range(step, len(batches)):
        losses[i + 1] = float(cell(ms.Tensor(batches[i]))[0].asnumpy().reshape(-1)[0])
    return {"losses": losses, "step": step, "global_step": global_step}


def load_2x(yaml: str, hf: str) -> dict:
    """MindFormers 2.x's side of an export in its 2.x layout: the YAML's network (use_legacy: False) and
    AdamW, loaded by its own 2.x loader (mindformers.checkpoint.load_checkpoint, as the trainer resumes),
    against the exported run's Hugging Face tensors put in MindFormers' layout by its own converter
    (Qwen3's convert_weight_dict: ModelMixin.convert_name, concat_qkv_weight_megatron,
    concat_ffn_weight_megatron; TeleChat3 has the same names and layout but no converter of its own)."""
    from mindformers.checkpoint.checkpoint import load_checkpoint
    from mindformers.core.context.build_context import MFContextOperator
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
    from mindformers.models.telechat3.configuration_telechat3 import TeleChat3Config
    from mindformers.models.telechat3.modeling_telechat3_train import TrainingTeleChat3ForCausalLM
    from safetensors.numpy import load_file

    cfg = MindFormerConfig(yaml)
    MFContextOperator.get_mf_ctx_instance().set_context(use_legacy=False)
    model_config = dict(cfg.model.model_config)
    classes = {"qwen3": (Qwen3Config, TrainingQwen3ForCausalLM),
               "telechat3": (TeleChat3Config, TrainingTeleChat3ForCausalLM)}[model_config["model_type"]]
    net = classes[1](classes[0](**model_config))
    lr = build_lr(cfg.lr_schedule)
    optimizer = build_optim(cfg.optimizer, default_args={
        "params": get_optimizer_grouped_parameters(net, cfg.optimizer.weight_decay, lr), "learning_rate": lr})
    load_checkpoint(cfg.checkpoint.load_path, net, optimizer)
    expected = TrainingQwen3ForCausalLM.convert_weight_dict(net, load_file(hf))
    held = {p.name: p for p in [*net.get_parameters(), *optimizer.get_parameters()]}
    found: dict[str, bool] = {}
    for name, value in expected.items():
        found[name] = bool(name in held and np.array_equal(held[name].asnumpy(), value))
    weights = [p.name for p in net.get_parameters()]
    return {"compared": len(found), "equal": sum(found.values()), "unequal": [n for n, ok in found.items() if not ok],
            "weights_not_compared": [n for n in weights if n not in found],
            "global_step": int(optimizer.global_step.asnumpy().reshape(-1)[0])}


def run(request: dict) -> dict:
    config = MindFormerConfig(request["yaml"])
    step_cell = build(config)
    step_cell.set_train(True)
    rows = np.load(request["batches"]).astype(np.int32)
    result = train(config, step_cell, rows, request["save"]) if request["mode"] == "train" else \
        resume(step_cell, rows, request["load"])
    if request.get("load_2x"):
        result["v2"] = load_2x(request["load_2x"], request["hf"])
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        request = json.load(f)
    while request:
        result = run(request)
        with open(request["out"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(request["out"] + ".tmp", request["out"])
        request = next_spec(request["then"]) if request.get("then") else {}
