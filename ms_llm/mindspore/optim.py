"""AdamW with torch.optim.AdamW's exact arithmetic, and global-norm clipping, for one graph.

MindSpore's nn.AdamWeightDecay has no bias correction, so its updates differ from torch's;
both backends must follow one loss curve, so the update is written out here (weight decay on
the parameters OptimizerConfig.decays names, wd = 0 on the others: the rule of the torch backend
and the shared ZeRO engine):

    p <- p * (1 - lr * wd)
    m <- m + (g - m) * (1 - beta1);  v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

It is an nn.Optimizer whose moments are `parameters.clone(...)`, which is what MindSpore's
parallel optimizer (ZeRO under semi_auto_parallel on Ascend) shards. The learning rate of the
step, from the shared schedule, is an input of the graph (a Parameter set from the host is
read stale inside the skip-on-overflow branch) and is recorded in `learning_rate`;
t counts applied updates (a step skipped for a loss-scale overflow does not count), as in
torch.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.train import OptimizerConfig

_adamw = ops.MultitypeFuncGraph("adamw")


@_adamw.register("Number", "Number", "Number", "Tensor", "Tensor", "Tensor", "Number", "Tensor", "Tensor", "Tensor",
                 "Tensor")
def _adamw_update(beta1, beta2, eps, lr, step_size, bias2_sqrt, wd, param, m, v, grad):
    """One parameter's update, in place; returns the new parameter value. The depend chain keeps
    every assignment in the graph (an assignment nothing depends on can be dropped)."""
    grad = ops.cast(grad, ms.float32)
    p = param * (1.0 - lr * wd)
    m_new = m + (grad - m) * (1.0 - beta1)
    v_new = v * beta2 + grad * grad * (1.0 - beta2)
    p = p - step_size * m_new / (ops.sqrt(v_new) / bias2_sqrt + eps)
    p = ops.depend(p, ops.assign(param, p))
    p = ops.depend(p, ops.assign(m, m_new))
    return ops.depend(p, ops.assign(v, v_new))


class AdamW(nn.Optimizer):
    def __init__(self, params: list[Parameter], cfg: OptimizerConfig):
        super().__init__(float(cfg.lr), params)
        self.beta1, self.beta2, self.eps = cfg.beta1, cfg.beta2, cfg.eps
        # One constant per parameter, in the parameters' order (group params would reorder them):
        # wd, or 0.0 where the rule exempts it (1 - lr * 0.0 is exactly 1).
        self.decays = tuple(cfg.weight_decay if cfg.decays(tuple(p.shape)) else 0.0 for p in self.parameters)
        self.exp_avg = self.parameters.clone(prefix="exp_avg", init="zeros")
        self.exp_avg_sq = self.parameters.clone(prefix="exp_avg_sq", init="zeros")
        self.step = Parameter(Tensor(0.0, ms.float32), name="optimizer.step", requires_grad=False)
        self.hyper_map = ops.HyperMap()

    def set_step(self, steps: int) -> None:
        self.step.set_data(Tensor(float(steps), ms.float32))

    def construct(self, gradients, lr):
        lr = ops.depend(lr, ops.assign(self.learning_rate, lr))
        step = self.step + 1.0
        ops.assign(self.step, step)
        bias1 = 1.0 - ops.pow(Tensor(self.beta1, ms.float32), step)
        bias2_sqrt = ops.sqrt(1.0 - ops.pow(Tensor(self.beta2, ms.float32), step))
        return self.hyper_map(ops.partial(_adamw, self.beta1, self.beta2, self.eps, lr, lr / bias1, bias2_sqrt),
                              self.decays, self.parameters, self.exp_avg, self.exp_avg_sq, gradients)


# The grad_scale attribute makes MindSpore's auto-parallel pass count each shard of a sharded
# gradient once (and each replica not again) when it reduces the squares over the mesh, as
# MindFormers' ClipGradNorm relies on; without auto-parallel it is a plain ExpandDims.
_expand_dims = ops.ExpandDims().add_prim_attr("grad_scale", True)
_square_sum = ops.MultitypeFuncGraph("square_sum")


@_square_sum.register("Tensor")
def _square_sum_of(grad):
    return _expand_dims(ops.reduce_sum(ops.square(ops.cast(grad, ms.float32))), 0)


def global_norm(grads: tuple) -> Tensor:
    """sqrt of the sum of every gradient element's square, over the whole model: shape (1,)."""
    return ops.sqrt(ops.addn(ops.HyperMap()(_square_sum, grads)))


def clip_by_norm(grads: tuple, norm: Tensor, max_norm: float) -> tuple:
    """torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6))."""
    if max_norm <= 0:
        return grads
    coef = ops.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tuple(g * ops.cast(coef, g.dtype) for g in grads)
