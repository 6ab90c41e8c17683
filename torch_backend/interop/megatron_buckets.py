"""The distributed optimizer's state in bucket space: where each parameter's Adam state lies.

megatron-core's DistributedOptimizer keeps, per model-parallel rank (dp_group_idx = pp_rank * tp +
tp_rank), flat fp32 buffers of 'param', 'exp_avg' and 'exp_avg_sq'. _ParamAndGradBuffer lays the rank's
parameters out in reverse named_parameters() order, each start padded to a multiple of 64 elements,
buckets closing where per_bucket_numel_unpadded says. torch_dist's dp_reshardable saves each bucket as
one tensor (each parameter and padding a chunk of its own: the chunk edges check the layout); the legacy
distrib_optim.pt saves the buckets of a buffer concatenated. The parameter order within a layer is
module registration order, which differs between Megatron-LM's --transformer-impl local (norms as
modules) and transformer_engine (norms inside the fused linears): the saved arguments name it, and the
chunk edges decide when they do not.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ms_llm.checkpoint.storage.untrusted import integers
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError
from torch_backend.interop.megatron_files import single

ALIGN = 64          # _ParamAndGradBuffer._pad_start_of_param_if_needed
# Tensor-parallel splits of megatron-core's GPTModel (column-parallel: dim 0, row-parallel: dim 1;
# linear_fc1 holds [gate_r; up_r] on rank r). Unlisted tensors are replicated.
TP_SPLIT: dict[str, Any] = {
    "embedding.word_embeddings.weight": 0, "output_layer.weight": 0,
    "decoder.layers.self_attention.linear_qkv.weight": 0, "decoder.layers.self_attention.linear_qkv.bias": 0,
    "decoder.layers.self_attention.linear_proj.weight": 1, "decoder.layers.mlp.linear_fc2.weight": 1,
    "decoder.layers.mlp.linear_fc1.weight": "rows"}


def tp_merge(key: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of the model from its tensor-parallel shards, in tp-rank order."""
    how = TP_SPLIT.get(key)
    if how is None or len(shards) == 1:
        return shards[0]
    if how == "rows":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=how)


def stage_layers(num_layers: int, pp: int, args: Any) -> list[tuple[int, int]]:
    """(pipeline stage, index within the stage) of every layer, as Megatron-LM splits them (evenly, or
    --decoder-first/last-pipeline-num-layers with the rest even)."""
    first = getattr(args, "decoder_first_pipeline_num_layers", None) or 0
    last = getattr(args, "decoder_last_pipeline_num_layers", None) or 0
    counts = [0] * pp
    if pp > 1 and (first or last):
        inner = pp - bool(first) - bool(last)
        each = (num_layers - first - last) // inner if inner else 0
        counts = [each] * pp
        counts[0], counts[-1] = (first or each), (last or each)
    else:
        counts = [num_layers // pp] * pp
    if sum(counts) != num_layers:
        raise CheckpointError(f"{num_layers} layers do not split over {pp} pipeline stages as {counts}")
    return [(s, i) for s, n in enumerate(counts) for i in range(n)]


def layer_params(model: ModelConfig, impl: str, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """One layer's parameters on a tensor-parallel rank, in registration order: (key under decoder.layers, shape)."""
    h, hd, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    rows = (model.num_heads + 2 * model.num_kv_heads) * hd // tp
    norm = [("self_attention.linear_qkv.layer_norm_weight", (h,))]
    proj = [("self_attention.linear_proj.weight", (h, model.num_heads * hd // tp))]
    qkv = [("self_attention.linear_qkv.weight", (rows, h))] + ([("self_attention.linear_qkv.bias", (rows,))]
                                                                if model.qkv_bias else [])
    qk = ([("self_attention.q_layernorm.weight", (hd,)), ("self_attention.k_layernorm.weight", (hd,))]
          if model.qk_norm else [])
    mlp = [("mlp.linear_fc1.layer_norm_weight", (h,)), ("mlp.linear_fc1.weight", (2 * f // tp, h)),
           ("mlp.linear_fc2.weight", (h, f // tp))]
    return norm + proj + qkv + qk + mlp if impl == "local" else proj + norm + qkv + qk + mlp


def rank_params(model: ModelConfig, impl: str, tp: int, stage: int, pp: int,
                stages: list[tuple[int, int]]) -> list[tuple[str, Optional[int], tuple[int, ...]]]:
    """A model-parallel rank's parameters in named_parameters() order: (Megatron key, layer, local shape)."""
    out: list[tuple[str, Optional[int], tuple[int, ...]]] = []
    if stage == 0:
        out.append(("embedding.word_embeddings.weight", None, (model.vocab_size // tp, model.hidden_size)))
    for layer, (s, _) in enumerate(stages):
        if s == stage:
            out += [("decoder.layers." + key, layer, shape) for key, shape in layer_params(model, impl, tp)]
    if stage == pp - 1:
        out.append(("decoder.final_layernorm.weight", None, (model.hidden_size,)))
        if not model.tie_embeddings or pp > 1:
            out.append(("output_layer.weight", None, (model.vocab_size // tp, model.hidden_size)))
    return out


def place(params: list, sizes: list[int], edges: Optional[list[set[int]]]) -> Optional[list[tuple[int, int]]]:
    """(bucket, start) of each parameter, walking them in reverse as _ParamAndGradBuffer does; None
    when they do not fill the buckets exactly or a start or end is not a chunk edge."""
    spots: list[tuple[int, int]] = [(0, 0)] * len(params)
    bucket, pos = 0, 0
    for i in reversed(range(len(params))):
        n, start = math.prod(params[i][2]), -(-pos // ALIGN) * ALIGN
        if start + n > sizes[bucket]:            # the bucket closed before this parameter, at its end
            if sizes[bucket] not in (pos, start) or bucket + 1 == len(sizes):
                return None
            bucket, start = bucket + 1, 0
            if n > sizes[bucket]:
                return None
        if edges is not None and not {start, start + n} <= edges[bucket]:
            return None
        spots[i], pos = (bucket, start), start + n
    return spots if bucket == len(sizes) - 1 and pos == sizes[-1] else None


def plain_slots(params: list, groups: list[dict], decay_qk_norm: bool) -> Optional[list[tuple[int, int, Any]]]:
    """(group, position in it, state index) of each of a rank's `params` (named_parameters() order) in the
    non-distributed optimizer's state_dict: megatron-core's _get_param_groups keeps model order within a
    group and puts the default group (decayed) before the wd_mult 0 one (1-D parameters and biases; the q/k
    layernorms stay decayed with --apply-wd-to-qk-layernorm); torch's state is keyed by each group's
    'params' indices. None when the saved groups are not those (or one group of all) or not these counts."""
    def exempt(key: str, shape: tuple[int, ...]) -> bool:
        qk = "q_layernorm." in key or "k_layernorm." in key
        return (len(shape) == 1 or key.endswith(".bias")) and not (decay_qk_norm and qk)

    mults = [g.get("wd_mult") for g in groups]
    if mults == [1.0]:
        members = [list(range(len(params)))]
    elif mults == [1.0, 0.0]:
        members = [[i for i, p in enumerate(params) if exempt(p[0], p[2]) == bool(g)] for g in range(2)]
    else:
        return None
    indices = [g.get("params") for g in groups]
    if any(not isinstance(ix, list) or len(ix) != len(m) for ix, m in zip(indices, members)):
        return None
    slots: list = [None] * len(params)
    for g, member in enumerate(members):
        for j, i in enumerate(member):
            slots[i] = (g, j, indices[g][j])
    return slots


class Buckets:
    """Reads one parameter's state (whole, tensor-parallel shards merged) out of the buckets."""

    def __init__(self, model: ModelConfig, tp: int, pp: int, stages, where: str):
        self.model, self.tp, self.pp, self.stages, self.where = model, tp, pp, stages, where
        self.spots: dict[tuple[str, Optional[int], int], tuple[Any, tuple[int, ...]]] = {}   # -> (reader, shape)
        self.states: set[str] = set()
        self.common: dict = {}          # the optimizer's own state dict (param groups, grad scaler)

    @classmethod
    def from_dist(cls, files, model: ModelConfig, args, where: str) -> "Buckets":
        tp, pp = _degree(args, "tensor_model_parallel_size"), _degree(args, "pipeline_model_parallel_size")
        self = cls(model, tp, pp, _stages(model, pp, args), where)
        for g in range(tp * pp):
            base = f"optimizer.distributed.dp_group_idx_{g}"
            sizes_key = f"{base}.per_bucket_numel_unpadded/shard_0_1"
            if sizes_key not in files.objects:
                raise CheckpointError(f"{where}: dp_reshardable optimizer state lacks {sizes_key!r} (tensor-parallel "
                                      f"{tp} x pipeline {pp} from its arguments)")
            buffers = single(files.obj(sizes_key), f"{where}: {sizes_key}")
            if not isinstance(buffers, list) or len(buffers) != 1 or not isinstance(buffers[0], dict) \
                    or len(buffers[0]) != 1:
                raise CheckpointError(f"{where}: {sizes_key} is not one buffer's bucket sizes; ms_llm reads one "
                                      "parameter dtype per rank")
            sizes = list(integers(next(iter(buffers[0].values())), where, sizes_key, lo=1))
            found = [k[:-len("0.exp_avg")] for k in files.tensors if k.startswith(f"{base}.gbuf_idx_")
                     and k.endswith(".bucket_idx_0.exp_avg")]
            if len(found) != 1 or ".gbuf_idx_0." not in found[0]:
                raise CheckpointError(f"{where}: finds {len(found)} buffers of {base}; ms_llm reads one")
            prefix = found[0]
            lacking = [b for b in range(len(sizes)) if not files.has_tensor(f"{prefix}{b}.exp_avg")]
            if lacking:
                raise CheckpointError(f"{where}: {sizes_key} names {len(sizes)} buckets, but bucket {lacking[0]} of "
                                      f"{base} is not stored")
            edges = [files.boundaries(f"{prefix}{b}.exp_avg") for b in range(len(sizes))]
            self.states |= {s for s in ("param", "exp_avg", "exp_avg_sq") if files.has_tensor(f"{prefix}0.{s}")}
            self._lay_out(g, args, sizes, edges, lambda state, b, start, n, p=prefix:
                          files.read(f"{p}{b}.{state}", (start,), (n,)))
            key = f"{base}.optimizer/shard_0_1"
            if g == 0 and key in files.objects:
                common = single(files.obj(key), f"{where}: {key}")
                self.common = common if isinstance(common, dict) else {}
        return self

    @classmethod
    def from_legacy(cls, states: dict, model: ModelConfig, args, tp: int, pp: int, where: str) -> "Buckets":
        self = cls(model, tp, pp, _stages(model, pp, args), where)
        for (t, p), state in states.items():
            buffers = {k: v for k, v in state.items() if isinstance(k, int)}
            flat = next(iter(buffers[0].values()), None) if list(buffers) == [0] and len(buffers[0]) == 1 else None
            if not isinstance(flat, dict) or not isinstance(flat.get("numel_unpadded"), int):
                raise CheckpointError(f"{where}: distrib_optim.pt of rank ({t}, {p}) holds {len(buffers)} buffers; "
                                      "ms_llm reads one buffer of one parameter dtype per rank")
            self.states |= {s for s in ("param", "exp_avg", "exp_avg_sq") if s in flat}
            for s in self.states:
                if not isinstance(flat.get(s), torch.Tensor) or flat[s].shape != (flat["numel_unpadded"],):
                    raise CheckpointError(f"{where}: distrib_optim.pt of rank ({t}, {p}): {s!r} is not a flat tensor "
                                          f"of the buffer's {flat['numel_unpadded']} elements")
            self._lay_out(p * tp + t, args, [int(flat["numel_unpadded"])], None,
                          lambda s, b, start, n, flat=flat: flat[s][start:start + n])
        return self

    def _lay_out(self, g: int, args, sizes: list[int], edges, read) -> None:
        t, p = g % self.tp, g // self.tp
        named = getattr(args, "transformer_impl", "transformer_engine")
        for impl in dict.fromkeys((named, "local", "transformer_engine")):
            params = rank_params(self.model, impl, self.tp, p, self.pp, self.stages)
            spots = place(params, sizes, edges)
            if spots is not None:
                break
        else:
            raise CheckpointError(f"{self.where}: the distributed optimizer's buckets of tensor-parallel rank {t}, "
                                  f"pipeline rank {p} ({sizes} elements) do not hold this model's parameters in "
                                  "megatron-core's layout: the optimizer state of another model? (or re-save with "
                                  "--dist-ckpt-optim-fully-reshardable)")
        for (key, layer, shape), (b, start) in zip(params, spots):
            self.spots[(key, layer, t)] = (lambda s, b=b, st=start, n=math.prod(shape): read(s, b, st, n), shape)

    def has(self, state: str) -> bool:
        return state in self.states

    def read(self, state: str, key: str, layer: Optional[int]) -> torch.Tensor:
        shards = []
        for t in range(self.tp):
            read, shape = self.spots[(key, layer, t)]
            shards.append(torch.as_tensor(read(state)).reshape(shape).float())
        return tp_merge(key, shards)


def _degree(args, name: str) -> int:
    value = getattr(args, name, 1) if args is not None else 1
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def _stages(model: ModelConfig, pp: int, args) -> list[tuple[int, int]]:
    return stage_layers(model.num_layers, pp, args)
