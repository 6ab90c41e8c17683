"""One optimizer step as one compiled graph: micro-batch gradients, data-parallel averaging,
clipping, AdamW. Inputs are stacked micro-batches (M, B, T) so the whole step compiles once."""
from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import nn, ops

from ms_llm.mindspore.model import LossCell
from ms_llm.mindspore.optim import AdamW, clip_by_global_norm


class TrainStep(nn.Cell):
    def __init__(self, loss_cell: LossCell, optimizer: AdamW, micro_batches: int, grad_clip: float,
                 reducer: Optional[nn.Cell] = None, loss_mean: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.loss_cell, self.optimizer, self.reducer, self.loss_mean = loss_cell, optimizer, reducer, loss_mean
        self.weights = optimizer.params
        self.micro_batches, self.grad_clip = micro_batches, grad_clip
        self.grad_fn = ms.value_and_grad(loss_cell, None, self.weights)

    def construct(self, inputs, labels, lr):
        loss, grads = self.grad_fn(inputs[0], labels[0])
        for i in range(1, self.micro_batches):
            mb_loss, mb_grads = self.grad_fn(inputs[i], labels[i])
            loss = loss + mb_loss
            grads = tuple(g + h for g, h in zip(grads, mb_grads))
        if self.micro_batches > 1:
            loss = loss / self.micro_batches
            grads = tuple(g / self.micro_batches for g in grads)
        if self.reducer is not None:          # data parallel: average over dp ranks
            grads = self.reducer(grads)
            loss = self.loss_mean(loss)
        grads, norm = clip_by_global_norm(grads, self.grad_clip)
        self.optimizer(grads, lr)
        return loss, norm
