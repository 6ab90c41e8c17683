"""AdamW with torch.optim.AdamW's exact arithmetic, gradient-norm clipping, and ZeRO shards.

MindSpore's nn.AdamWeightDecay has no bias correction, so its updates differ from
torch's; both backends must follow one loss curve, so the update is written out here:

    p <- p * (1 - lr * wd)           (wd = 0 for 1-D parameters: norms, as the torch backend)
    m <- m + (g - m) * (1 - beta1);  v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

With ZeRO (stage 1/2) a parameter's optimizer states hold only this rank's shard (the
ModelPlan's zero layout): the averaged gradient is cut to the shard (MindSpore's CPU
collectives have no ReduceScatter, so AllReduce-then-slice stands in), the shard is
updated, and AllGather over the shard group rebuilds the full parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.train import OptimizerConfig


@dataclass(frozen=True)
class ZeroShard:
    """This rank's piece of one parameter: `index` of `parts` equal slices along `dim`,
    gathered over `group` (whose rank order is the slice order)."""
    dim: int
    index: int
    parts: int
    group: str


class ShardedParam(nn.Cell):
    """Slice a full tensor to this rank's shard, and gather shards back into the full tensor."""

    def __init__(self, shard: ZeroShard):
        super().__init__()
        self.dim, self.index = shard.dim, shard.index
        self.split = ops.Split(axis=shard.dim, output_num=shard.parts)
        self.gather = ops.AllGather(group=shard.group)      # concatenates along dim 0
        self.transpose = ops.Transpose()

    def local(self, x):
        return self.split(x)[self.index]

    def full(self, x):
        if self.dim == 0:
            return self.gather(x)
        perm = tuple([self.dim] + [i for i in range(x.ndim) if i != self.dim])
        back = tuple(int(np.argsort(perm)[i]) for i in range(x.ndim))
        return self.transpose(self.gather(self.transpose(x, perm)), back)


class AdamW(nn.Cell):
    def __init__(self, params: list[Parameter], cfg: OptimizerConfig,
                 shards: Optional[list[Optional[ZeroShard]]] = None):
        super().__init__(auto_prefix=False)
        shards = shards or [None] * len(params)
        self.params = ms.ParameterTuple(params)
        self.beta1, self.beta2, self.eps = cfg.beta1, cfg.beta2, cfg.eps
        self.wd = tuple(cfg.weight_decay if len(p.shape) >= 2 else 0.0 for p in params)
        self.sharded = tuple(s is not None for s in shards)
        self.shard_cells = nn.CellList([ShardedParam(s) for s in shards if s is not None])
        self.shard_slot = tuple(sum(self.sharded[:i]) for i in range(len(params)))

        def state(prefix):
            out = []
            for p, s in zip(params, shards):
                shape = list(p.shape)
                if s is not None:
                    shape[s.dim] //= s.parts
                out.append(Parameter(Tensor(np.zeros(shape, np.float32)), name=f"{prefix}.{p.name}",
                                     requires_grad=False))
            return ms.ParameterTuple(out)

        self.exp_avg = state("exp_avg")
        self.exp_avg_sq = state("exp_avg_sq")
        self.step = Parameter(Tensor(0.0, ms.float32), name="optimizer.step", requires_grad=False)
        self.assign = ops.Assign()
        self.sqrt = ops.Sqrt()
        self.pow = ops.Pow()

    def construct(self, grads, lr):
        step = self.step + 1.0
        self.assign(self.step, step)
        bias1 = 1.0 - self.pow(Tensor(self.beta1, ms.float32), step)
        bias2_sqrt = self.sqrt(1.0 - self.pow(Tensor(self.beta2, ms.float32), step))
        step_size = lr / bias1
        for i in range(len(self.params)):
            param, grad = self.params[i], grads[i]
            p = param * 1.0
            if self.sharded[i]:
                shard = self.shard_cells[self.shard_slot[i]]
                p, grad = shard.local(p), shard.local(grad)
            p = p * (1.0 - lr * self.wd[i])
            m = self.exp_avg[i] + (grad - self.exp_avg[i]) * (1.0 - self.beta1)
            v = self.exp_avg_sq[i] * self.beta2 + grad * grad * (1.0 - self.beta2)
            p = p - step_size * m / (self.sqrt(v) / bias2_sqrt + self.eps)
            self.assign(self.exp_avg[i], m)
            self.assign(self.exp_avg_sq[i], v)
            if self.sharded[i]:
                p = self.shard_cells[self.shard_slot[i]].full(p)
            self.assign(param, p)
        return step


def clip_by_global_norm(grads: tuple, max_norm: float) -> tuple:
    """torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)); returns (grads, norm)."""
    total = ops.reduce_sum(grads[0] * grads[0])
    for g in grads[1:]:
        total = total + ops.reduce_sum(g * g)
    norm = ops.sqrt(total)
    if max_norm <= 0:
        return grads, norm
    coef = ops.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tuple(g * coef for g in grads), norm
