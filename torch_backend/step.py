"""One training step on this rank: forward/backward over the micro-batches (or the pipeline
schedule), gradient reduction, clipping, learning rate, optimizer. The trainer loop and the
overhead benchmark both call exactly this.

fp16 (strategy.precision.loss_scale dynamic / static): each micro-batch's loss is multiplied by
the scale before backward, the engine divides the gradients back before clipping and skips
the update of a step whose global gradient norm is not finite (that norm is returned), and
the scale moves by ms_llm.run.loss_scale's policy.

DeepSeek-style models: the multi-token prediction loss trains with the logits (the model gets
the targets) and is reported apart (`mtp_loss`); after every optimizer step each router's
aux-loss-free expert bias moves by the step's expert loads, summed over all ranks so that every
rank applies the same update."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import OptimizerConfig
from ms_llm.run import LossScaler, lr_at
from torch_backend.apply import Lowered, cross_entropy, local_value
from torch_backend.moe import MoE
from torch_backend.mtp import MTP
from torch_backend.parallelize.cp import cp_positions
from torch_backend.weights import canonical_name


def optimizer_args(opt: OptimizerConfig, params: list[nn.Parameter]) -> tuple[type, list, dict]:
    """(class, params or param groups, kwargs). Weight decay applies to the parameters
    OptimizerConfig.decays names (all, or with weight_decay_1d false those of 2+ dims: a second
    group without decay, kwargs keeping the decay), as in the shared ZeRO engine and the MindSpore
    optimizer, so all engines follow one update rule."""
    if opt.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": opt.lr, "weight_decay": opt.weight_decay}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps,
                                          "weight_decay": opt.weight_decay}
    exempt = [p for p in params if not opt.decays(tuple(p.shape))]
    if not exempt:
        return cls, params, kwargs
    decayed = [p for p in params if opt.decays(tuple(p.shape))]
    groups = ([{"params": decayed}] if decayed else []) + [{"params": exempt, "weight_decay": 0.0}]
    return cls, groups, kwargs


def biased_routers(model: ModelConfig) -> list[str]:
    """Every MoE layer with an expert bias, by module name, in one order on every rank."""
    if model.moe is None or not model.moe.expert_bias:
        return []
    names = [f"model.layers.{i}.mlp" for i in model.moe_layers]
    return names + [f"model.mtp.{d}.layer.mlp" for d in range(model.mtp_layers)
                    if model.is_moe_layer(model.num_layers + d)]


class TrainStep:
    def __init__(self, lowered: Lowered):
        self.m, self.plan = lowered, lowered.plan
        self.params = [p for part in lowered.parts for p in part.parameters()]
        cls, params, kwargs = optimizer_args(self.plan.train.optimizer, self.params)
        self.optimizer = lowered.dp.make_optimizer(params, cls, kwargs)
        meshes, s = lowered.meshes, self.plan.strategy
        self.pp_group = meshes.group("pp") if s.pp > 1 else None
        # The global loss: summed over the ranks that hold a loss once per data-parallel replica
        # and cp rank (last stage, tp rank 0), each weighted 1/(dp*cp): cp ranks hold equal
        # numbers of tokens, so the mean of their means is the replica's mean.
        holds = lowered.has_last and meshes.coord("tp") == 0
        self.loss_weight = (1.0 if holds else 0.0) / (s.dp * s.cp)
        # Context parallel: this rank's sequence positions (the same columns of every row).
        self.positions = None
        if lowered.lowering.cp is not None:
            cp = lowered.lowering.cp
            self.positions = torch.tensor(cp_positions(self.plan.train.seq_len, cp.degree, meshes.coord("cp"),
                                                       cp.balanced), device=lowered.device)
        # MoE router losses: every stage's layers add theirs (tp rank 0), each a mean over this
        # rank's tokens, so weighted 1/(dp*cp) like the loss.
        self.moe = [mod for part in lowered.parts for mod in part.modules() if isinstance(mod, MoE)]
        self.aux_weight = (1.0 if meshes.coord("tp") == 0 else 0.0) / (s.dp * s.cp)
        # Multi-token prediction: its loss rides on the logits like the router losses, held where
        # the loss is (weighted alike; under pipeline parallel, the last stage), and is reported apart.
        self.mtp = [mod for part in lowered.parts for mod in part.modules() if isinstance(mod, MTP)]
        self.mtp_loss: Optional[torch.Tensor] = None          # the last step's global mean MTP loss
        # Aux-loss-free balancing: row i of the loads all-reduced each step is router bias_names[i].
        self.bias_names = biased_routers(self.plan.model)
        local = {canonical_name(n): mod for part in lowered.parts for n, mod in part.named_modules()
                 if isinstance(mod, MoE)}
        self.biased = [(i, local[n]) for i, n in enumerate(self.bias_names) if n in local]
        self.expert_loads: Optional[torch.Tensor] = None      # the last step's (routers, experts) loads, rows
                                                              # of this rank's stage summed over its ranks
        self.world = self.plan.world_size
        self.loss_scale = LossScaler.from_precision(s.precision)      # None without fp16 loss scaling

    def context_share(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) -> (B, T / cp): this cp rank's columns (all of them without context parallel)."""
        if self.positions is None:
            return tokens, targets
        return tokens[:, self.positions], targets[:, self.positions]

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients of the local batch (B, T); return this rank's mean loss."""
        m, n = self.m, self.plan.micro_batches
        tokens, targets = self.context_share(tokens, targets)
        # Each micro-batch's losses are weighted 1/n (times the fp16 loss scale) before backward, the
        # schedule's too: it does not divide gradients by n afterwards (pipeline.build_schedule), which
        # gradients already taken out of autograd (the shared ZeRO engine's sharded buckets) would miss.
        scale = (1.0 if self.loss_scale is None else self.loss_scale.scale) / n
        for owner in self.moe + self.mtp:
            owner.aux_scale = scale
        if m.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (tokens,) if m.has_first else ()
            # The schedule's last backward need not end the step (reduce_grads does), so
            # engines that reduce from backward hooks accumulate through all of it.
            # The stage of the MTP modules gets the targets as a forward argument too (split into
            # micro-batches like the inputs): its MTP loss rides on the logits the loss_fn reads.
            mtp_targets = {"targets": targets} if self.mtp else {}
            with m.dp.sync(m.parts[0], last=False), m.loss_context(), m.autocast():
                m.schedule.step(*args, target=targets if m.has_last else None, losses=losses,
                                loss_kwargs={"scale": scale}, **mtp_targets)
            if not losses:
                return torch.zeros((), device=m.device)
            return torch.stack([local_value(l).detach().float() for l in losses]).mean() / scale
        part, total = m.parts[0], torch.zeros((), device=m.device)
        for i, (x, y) in enumerate(zip(tokens.chunk(n), targets.chunk(n))):
            with m.dp.sync(part, last=i == n - 1), m.loss_context():
                with m.autocast():
                    logits = part(x, targets=y) if self.mtp else part(x)     # targets: the MTP loss
                    loss = cross_entropy(logits, y) / n          # mean over the local batch
                (loss if self.loss_scale is None else loss * self.loss_scale.scale).backward()
            total += local_value(loss.detach())
        return total

    def __call__(self, step: int, batch: torch.Tensor,
                 before_update: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: (B_local, T + 1) token ids. Returns (global mean loss, grad norm), unsynced; under
        loss scaling a skipped step's norm is the non-finite one. `before_update` runs after the
        gradients are reduced and before the optimizer (the shared loop's checkpoint fence):
        until then the step only reads weights and optimizer states."""
        batch = batch.to(self.m.device, non_blocking=True)
        loss = self.forward_backward(batch[:, :-1], batch[:, 1:])
        n = self.plan.micro_batches
        aux = sum((moe.take_aux(n) for moe in self.moe), torch.zeros(())) / n
        # local_value: under tp the MTP loss is loss_parallel's DTensor
        mtp = sum((local_value(owner.take_aux(n)) for owner in self.mtp), torch.zeros(())) / n
        self.m.dp.reduce_grads(self.m.parts)
        if before_update is not None:
            before_update()
        scale = None if self.loss_scale is None else self.loss_scale.scale
        grad_norm = self.m.dp.step(self.optimizer, self.params, lr_at(step, self.plan.train),
                                   self.plan.train.optimizer.grad_clip, self.pp_group, scale)
        if self.loss_scale is not None:
            self.loss_scale.update(bool(torch.isfinite(grad_norm)), step + 1)
        self.update_expert_bias(n)
        if self.plan.model.mtp_layers:              # part of the loss; its global mean also apart
            mtp = mtp.to(loss.device)
            self.mtp_loss = self.global_mean(mtp)
            loss = loss + mtp
        return self.global_mean(loss, aux.to(loss.device)), grad_norm

    @torch.no_grad()
    def update_expert_bias(self, micro_batches: int) -> None:
        """Each router's expert loads over the step, summed over every rank (a layer's dp / cp / tp /
        ep ranks alike; zero rows where a pipeline stage lacks the layer, so one all-reduce serves
        all), move its bias: the same loads, hence the same update, on every rank."""
        if not self.bias_names:
            return
        loads = torch.zeros(len(self.bias_names), self.plan.model.moe.num_experts, device=self.m.device)
        for i, moe in self.biased:
            loads[i] = moe.take_load(micro_batches).to(loads.device)
        if self.world > 1:
            dist.all_reduce(loads)
        for i, moe in self.biased:
            moe.update_bias(loads[i])
        self.expert_loads = loads

    def global_mean(self, loss: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's mean loss (plus its MoE router losses, `aux`) -> the global batch's, the
        same on every rank."""
        if self.world > 1:
            loss = loss * self.loss_weight + (0.0 if aux is None else aux * self.aux_weight)
            dist.all_reduce(loss)
        elif aux is not None:
            loss = loss + aux
        return loss

    @torch.no_grad()
    def evaluate(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean loss of a validation batch (B_local, T + 1), forward only, under the same lowering
        (the pipeline schedule's eval, vocab-parallel loss, autocast); the same on every rank."""
        m, n = self.m, self.plan.micro_batches
        batch = batch.to(m.device, non_blocking=True)
        tokens, targets = self.context_share(batch[:, :-1], batch[:, 1:])
        with m.loss_context(), m.autocast():
            if m.schedule is not None:
                losses: list[torch.Tensor] = []
                m.schedule.eval(*((tokens,) if m.has_first else ()), target=targets if m.has_last else None,
                                losses=losses)
                loss = (torch.stack([local_value(l).float() for l in losses]).mean() if losses
                        else torch.zeros((), device=m.device))
            else:
                loss = sum(local_value(cross_entropy(m.parts[0](x), y)) for x, y in
                           zip(tokens.chunk(n), targets.chunk(n))) / n
        return self.global_mean(loss)
