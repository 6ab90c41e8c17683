"""torchtitan's side of tests/checkpoint/test_import_torchtitan.py: one process, gloo, PYTHONPATH=.oracles
(torchtitan 0.3.0, torchdata).

torchtitan's Trainer picks a CUDA device and its data loader a tokenizer and a Hugging Face dataset, so
this is Trainer.train_step with torchtitan's own parts, configured by its own ConfigManager from the job's
command line: the llama3 model (torchtitan's blocks and init, fused q/k/v as its flavors build it) at the
test's tiny size, the job's loss (ChunkedLossWrapper over CrossEntropyLoss: sum / tokens),
OptimizersContainer, LRSchedulersContainer, dist_utils.clip_grad_norm_ and CheckpointManager with a
ParallelAwareDataloader over the test's batches (one document per row: positions 0..T-1). Two departures,
neither changing the math: attention is torchtitan's ScaledDotProductAttention (causal) because
FlexAttention has no backward on CPU (block-causal masking of one document per row is causal), and
parallelize_llama (FSDP of degree 1, whose mixed-precision policy is float32 in the test's job) is left out.

argv[1]: JSON {"mode": "train" | "resume", "args": [torchtitan job arguments], "model": {dim, n_layers,
n_heads, n_kv_heads, vocab_size, hidden_dim, max_seq_len, rope_theta, norm_eps}, "batches": .npy
(steps, global batch, seq + 1) of token ids, "out": JSON file}.
  train: trains every batch, saving as CheckpointManager decides (checkpoint.interval, the last step).
  resume: loads the newest step of checkpoint.folder (the job's arguments name it) and trains from it.
out: {"losses": {step: loss}, "lrs": {step: the lr it trained with}, "step": the step it began from}.
With "then": a path, the process waits (at most peer_probe.WAIT_S) for that file: the next spec of the same kind
(the resume of what the test made from this run meanwhile), or {} to stop. One start of torch and
torchtitan serves both.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
from peer_probe import next_spec



class Batches(IterableDataset):
    """The rows of the global batches from `start` on, as torchtitan's text datasets yield them."""

    def __init__(self, batches: np.ndarray):
        self.batches, self.start = torch.from_numpy(batches.astype(np.int64)), 0

    def __iter__(self):
        for batch in self.batches[self.start:]:
            for row in batch:
                yield {"input": row[:-1], "positions": torch.arange(len(row) - 1)}, row[1:]


class TrainState:
    """What torchtitan's Trainer saves as train_state."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def build_model(m: dict) -> Llama3Model:
    rope = ComplexRoPE.Config(dim=m["dim"] // m["n_heads"], max_seq_len=m["max_seq_len"], theta=m["rope_theta"])
    layers = _build_llama3_layers(n_layers=m["n_layers"], dim=m["dim"], n_heads=m["n_heads"],
                                  n_kv_heads=m["n_kv_heads"], hidden_dim=m["hidden_dim"], rope=rope,
                                  attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = m["norm_eps"]
    config = Llama3Model.Config(
        dim=m["dim"], vocab_size=m["vocab_size"], layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=m["vocab_size"], embedding_dim=m["dim"],
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=m["dim"], eps=m["norm_eps"]),
        lm_head=Linear.Config(in_features=m["dim"], out_features=m["vocab_size"]))
    model = config.build()
    model.init_weights(buffer_device=None)
    return model


def main(spec: dict) -> dict:
    cfg = ConfigManager().parse_args(spec["args"])
    torch.manual_seed(cfg.debug.seed)
    model = build_model(spec["model"])
    optimizers = cfg.optimizer.build(model_parts=[model])
    lr_schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.training.steps)
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):          # as the Trainer sets it up
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    data = Batches(np.load(spec["batches"]))
    dataloader = ParallelAwareDataloader(data, dp_rank=0, dp_world_size=1, batch_size=cfg.training.local_batch_size)
    state = TrainState()
    checkpointer = cfg.checkpoint.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                        lr_schedulers=lr_schedulers, states={"train_state": state}, sd_adapter=None,
                                        base_folder=cfg.dump_folder)
    if spec["mode"] == "resume" and not checkpointer.load():
        raise SystemExit(f"resume: nothing to load in {checkpointer.folder}")
    data.start, begin = state.step, state.step
    losses, lrs = {}, {}
    batches = iter(dataloader)
    while state.step < min(cfg.training.steps, len(data.batches)):      # Trainer.train_step, one micro-batch
        state.step += 1
        lrs[state.step] = optimizers.optimizers[0].param_groups[0]["lr"]
        optimizers.zero_grad()
        inputs, labels = next(batches)
        state.ntokens_seen += labels.numel()
        pred = model(inputs["input"], positions=inputs["positions"])
        loss, _ = loss_fn(pred, labels, (labels != -100).sum())
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), cfg.training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        losses[state.step] = loss.item()
        checkpointer.save(state.step, last_step=state.step == cfg.training.steps)
    checkpointer.close()
    return {"losses": losses, "lrs": lrs, "step": begin}


if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with open(sys.argv[1]) as f:
        request = json.load(f)
    while request:
        result = main(request)
        with open(request["out"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(request["out"] + ".tmp", request["out"])
        request = next_spec(request["then"]) if request.get("then") else {}
    dist.destroy_process_group()
