"""AdamW with torch.optim.AdamW's exact arithmetic, and gradient-norm clipping, in one graph.

MindSpore's nn.AdamWeightDecay has no bias correction, so its updates differ from
torch's; both backends must follow one loss curve, so the update is written out here
(weight decay on every parameter, the rule of the torch backend and the shared ZeRO engine):

    p <- p * (1 - lr * wd)
    m <- m + (g - m) * (1 - beta1);  v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

ZeRO is not here: sharded optimizer states are the shared engine's (ms_llm.mindspore.zero).
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.train import OptimizerConfig


class AdamW(nn.Cell):
    def __init__(self, params: list[Parameter], cfg: OptimizerConfig):
        super().__init__(auto_prefix=False)
        self.params = ms.ParameterTuple(params)
        self.beta1, self.beta2, self.eps, self.wd = cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay

        def state(prefix):
            return ms.ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"{prefix}.{p.name}",
                                                requires_grad=False) for p in params])

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
            p = param * (1.0 - lr * self.wd)
            m = self.exp_avg[i] + (grad - self.exp_avg[i]) * (1.0 - self.beta1)
            v = self.exp_avg_sq[i] * self.beta2 + grad * grad * (1.0 - self.beta2)
            p = p - step_size * m / (self.sqrt(v) / bias2_sqrt + self.eps)
            self.assign(self.exp_avg[i], m)
            self.assign(self.exp_avg_sq[i], v)
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
