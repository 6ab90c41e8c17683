"""megatron-core's side of tests/checkpoint/test_import_megatron.py: run under torchrun (one process per
tensor-parallel rank, gloo) with PYTHONPATH=.oracles (megatron-core 0.16.1).

Megatron-LM's trainer (pretrain_gpt.py) is not in megatron-core; this is its one-micro-batch step with
megatron-core's own parts: GPTModel (local layer spec) inside its DistributedDataParallel, the optimizer
get_megatron_optimizer builds (DistributedOptimizer over torch AdamW, which megatron-core picks when
neither Transformer Engine nor Apex is installed: decoupled weight decay, bias correction, eps outside the
square root, gradients clipped to --clip-grad by their global norm), OptimizerParamScheduler stepped by
the global batch in samples, finalize_model_grads. Weight decay follows megatron-core's default param
groups (1-D parameters and biases exempt), which the converted job reads as
train.optimizer.weight_decay_1d: false. Checkpoints are what Megatron-LM's save_checkpoint writes: torch_dist
(dist_checkpointing.save of generate_state_dict's keys: args, iteration, model, optimizer in the
distributed optimizer's default dp_reshardable sharding, opt_param_scheduler, rng_state, with the
content metadata) and the legacy per-rank mp_rank_XX/model_optim_rng.pt (torch.save), each beside
latest_checkpointed_iteration.txt.

CPU: megatron-core allocates on 'cuda' and checks 'torch.cuda.FloatTensor' type names in DDP and the
optimizer; the shim below maps those to the CPU (no arithmetic changes), and its CUDA RNG tracker is
bypassed (dropout is 0, nothing is drawn).

argv[1]: JSON {"mode": "train" | "load", "flags": {Megatron-LM flag: value or true}, "batches": .npy
(steps, global batch, seq + 1) of token ids, "out": folder, ...}:
  train: "save_at": N; trains len(batches) steps, saves at step N (torch_dist and legacy), records losses.
        With "plain": true a twin model trains the same batches under megatron-core's non-distributed
        optimizer (its state_dict in model_optim_rng.pt, param groups in model order) and saves at step N
        too, as plain_torch_dist and plain_legacy.
  load: "load": a checkpoint root; loads it the way Megatron-LM's load_checkpoint does and trains the
        batches from its iteration on.
Rank 0 writes out/result.json: {"losses": {step: loss}, "lrs": {step: its learning rate}, "start": the
iteration trained from, "consumed_samples"}.
With "then": a path, the ranks leave their world once it is written and rank 0 waits (at most peer_probe.WAIT_S)
for that file: a spec of the load mode with its own "out" ({} to stop), which it runs in a world of
its own (tensor parallel 1, one process). One start of torch and megatron-core serves both.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peer_probe import next_spec



def cpu_shim() -> None:
    def on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return make

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    type_name = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        out = type_name(self, *args, **kwargs)
        return out.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else out

    torch.Tensor.type = cuda_type


def megatron_args(flags: dict, world: int) -> argparse.Namespace:
    """The Namespace Megatron-LM's parse_args + validate_args would hold for `flags` (the fields a
    checkpoint's readers use), with the attention backend enum it stores."""
    from megatron.core.transformer.enums import AttnBackend

    args = {flag[2:].replace("-", "_"): value for flag, value in flags.items()}
    tp = int(args.get("tensor_model_parallel_size", 1))
    args.update(world_size=world, data_parallel_size=world // tp,
                add_bias_linear=not args.pop("disable_bias_linear", False),
                padded_vocab_size=int(args["vocab_size"]), add_position_embedding=False, use_dist_ckpt=True,
                consumed_train_samples=0, consumed_valid_samples=0, attention_backend=AttnBackend.auto,
                params_dtype=torch.float32, kv_channels=int(args["hidden_size"]) // int(args["num_attention_heads"]))
    for key, value in list(args.items()):
        if isinstance(value, str):
            for kind in (int, float):
                with contextlib.suppress(ValueError):
                    args[key] = kind(value)
                    break
    return argparse.Namespace(**args)


class Run:
    def __init__(self, spec: dict, distributed: bool = True):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.transformer_config import TransformerConfig

        mrandom.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
        a = self.args = megatron_args(spec["flags"], dist.get_world_size())
        a.use_distributed_optimizer = self.distributed = distributed
        torch.manual_seed(a.seed)
        config = TransformerConfig(
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size,
            tensor_model_parallel_size=a.tensor_model_parallel_size, use_cpu_initialization=True,
            normalization="RMSNorm", layernorm_epsilon=a.norm_epsilon, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
            bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
        self.model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                              vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                              position_embedding_type="rope", rotary_base=int(a.rotary_base),
                              share_embeddings_and_output_weights=not getattr(
                                  a, "untie_embeddings_and_output_weights", False))
        self.ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), self.model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad, use_distributed_optimizer=distributed),
            [self.ddp])
        gbs = a.global_batch_size
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters * gbs,
            lr_decay_steps=a.train_iters * gbs, lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay,
            end_wd=a.weight_decay, wd_incr_steps=a.train_iters * gbs, wd_incr_style="constant")
        self.iteration = 0

    def metadata(self) -> dict:
        """Megatron-LM's _build_sharded_state_dict_metadata (with --use-distributed-optimizer, or without)."""
        sharding = {"distrib_optim_sharding_type": "dp_reshardable"} if self.distributed else {}
        return {**sharding, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}

    def step(self, batch: np.ndarray) -> float:
        from megatron.core.distributed import finalize_model_grads

        tokens = torch.from_numpy(batch).long()
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self.ddp(inputs, positions, None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([self.ddp])
        ok, _, _ = self.optimizer.step()
        assert ok
        self.scheduler.step(increment=self.args.global_batch_size)
        self.iteration += 1
        self.args.consumed_train_samples += self.args.global_batch_size
        return loss.item()

    def state_dict(self, metadata: dict | None, loading: bool = False) -> dict:
        """Megatron-LM's generate_state_dict for --ckpt-format torch_dist."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core import parallel_state as ps

        sd = {"args": self.args, "checkpoint_version": 3.0, "iteration": self.iteration,
              "model": self.model.sharded_state_dict(metadata=metadata)}
        sd["optimizer"] = self.optimizer.sharded_state_dict(sd["model"], is_loading=loading, metadata=metadata)
        sd["opt_param_scheduler"] = self.scheduler.state_dict()
        if not loading:                     # loads as Megatron-LM's --no-load-rng: the export holds no RNG
            rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state()}]
            sd["rng_state"] = ShardedObject("rng_state", rng, (1, ps.get_tensor_model_parallel_world_size()),
                                            (0, ps.get_tensor_model_parallel_rank()), replica_id=0)
        sd["num_floating_point_operations_so_far"] = 0
        return sd

    def save(self, root: Path) -> None:
        from megatron.core import dist_checkpointing

        folder = root / f"iter_{self.iteration:07d}"
        if dist.get_rank() == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(self.state_dict(self.metadata()), str(folder), content_metadata=self.metadata())
        dist.barrier()
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text(str(self.iteration))

    def save_legacy(self, root: Path) -> None:
        """Megatron-LM's save_checkpoint with --ckpt-format torch: one file per tp rank (the distributed
        optimizer's parameter state goes to distrib_optim.pt beside it)."""
        from megatron.core import parallel_state as ps

        folder = root / f"iter_{self.iteration:07d}" / f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        folder.mkdir(parents=True)
        torch.save({"args": self.args, "checkpoint_version": 3.0, "iteration": self.iteration,
                    "model": self.model.state_dict_for_save_checkpoint(), "optimizer": self.optimizer.state_dict(),
                    "opt_param_scheduler": self.scheduler.state_dict(),
                    "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                   "torch_rng_state": torch.get_rng_state()}],
                    "num_floating_point_operations_so_far": 0}, folder / "model_optim_rng.pt")
        if self.distributed:
            self.optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text(str(self.iteration))

    def load(self, root: Path) -> None:
        """Megatron-LM's load_checkpoint for torch_dist: the tracker, the content metadata of the
        checkpoint, the sharded state dict built for loading with it, then model, optimizer, scheduler,
        iteration and consumed samples from what dist_checkpointing.load returns."""
        from megatron.core import dist_checkpointing

        # Two gaps of megatron-core's torch-AdamW fallback (Transformer Engine's and Apex's Adam keep no
        # per-parameter 'step'): the optimizer holds no state before its first step, which the
        # distributed optimizer's state_dict needs (its own dummy-state initialiser, a zero-gradient
        # step, fills it; the load overwrites every value), and _set_main_param_and_optimizer_states
        # copies every state key, 'step' included, which load_state_dict restores from the param groups
        # (the shim copies the keys the checkpoint gives).
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        def set_states(self, model_param, tensors):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            for key, value in {"param": main_param, **self.optimizer.state[main_param]}.items():
                if key in tensors:
                    value.copy_(tensors[key])

        DistributedOptimizer._set_main_param_and_optimizer_states = set_states
        for optimizer in self.optimizer.chained_optimizers:
            optimizer._init_optimizer_states_with_dummy_values()
        iteration = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
        folder = root / f"iter_{iteration:07d}"
        common = dist_checkpointing.load_common_state_dict(str(folder))
        metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
        sd = dist_checkpointing.load(self.state_dict(metadata, loading=True), str(folder))
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["opt_param_scheduler"])
        self.iteration = sd["iteration"]
        self.args.consumed_train_samples = sd["args"].consumed_train_samples


def main(spec: dict) -> None:
    """Run `spec` in the torchrun world, then, on rank 0 alone, the load spec its "then" names."""
    cpu_shim()
    dist.init_process_group("gloo")
    run_spec(spec)
    if not spec.get("then") or os.environ["RANK"] != "0":
        return
    nxt = next_spec(spec["then"])
    if nxt:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        run_spec(nxt)


def run_spec(spec: dict) -> None:
    """One spec in the current world: its model parallel groups made, used and destroyed with it."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(int(spec["flags"].get("--tensor-model-parallel-size", 1)), 1)
    run = Run(spec)
    twin = Run(spec, distributed=False) if spec.get("plain") else None
    out = Path(spec["out"])
    batches = np.load(spec["batches"])
    losses, lrs = {}, {}
    if spec["mode"] == "load":
        run.load(Path(spec["load"]))
    start = run.iteration
    for i in range(start, len(batches)):
        lrs[i + 1] = run.optimizer.param_groups[0]["lr"]
        losses[i + 1] = run.step(batches[i])
        if twin is not None and i < spec["save_at"]:
            twin.step(batches[i])
        if i + 1 == spec.get("save_at"):
            run.save(out / "torch_dist")
            run.save_legacy(out / "legacy")
            if twin is not None:
                twin.save(out / "plain_torch_dist")
                twin.save_legacy(out / "plain_legacy")
    if dist.get_rank() == 0:
        (out / "result.json.tmp").write_text(json.dumps({
            "losses": losses, "lrs": lrs, "start": start, "consumed_samples": run.args.consumed_train_samples}))
        os.replace(out / "result.json.tmp", out / "result.json")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
