"""Sparse mixture-of-experts feed-forward (Mixtral, DeepSeekMoE, Qwen3-MoE), parameter for parameter
the plan's MoE layer: router `mlp.gate.weight` (E, H) (with DeepSeek's aux-loss-free balancing, the
fp32 buffer `mlp.gate.e_score_correction_bias` (E,)), routed experts stacked as
`mlp.experts.{gate,up,down}_proj.weight` (E, F, H) / (E, H, F), and optional shared experts
`mlp.shared_experts.*` (a SwiGLU MLP of shared_experts x F, DeepSeek's layout).

Routing is Mixtral's (softmax over the router logits in fp32, top_k, optionally renormalised)
or DeepSeek-V3's (transformers' DeepseekV3TopkRouter, Megatron's topk router): sigmoid scores of
fp32 logits; experts chosen by score + expert bias, only from the best group_top_k of num_groups
groups; weighted by their scores (not the bias), renormalised, times routed_scaling_factor. The
expert bias moves after every optimizer step (TrainStep), by the loads this layer records.
Dispatch sorts the token copies by expert, runs the local experts together on their contiguous
rows (one grouped matmul per projection, class Experts) and scatters the weighted outputs back
(dropless, or capped at capacity_factor). Under expert parallelism (an `ep` group) the experts
are split over the group, and the sorted rows travel to the rank holding their expert by
all-to-all and back (Megatron's all-to-all token dispatcher). Each expert's width is split over
etp ranks (ms_llm.strategy.mesh folds the ranks as edp x ep x etp): with etp = tp (the default)
every tp rank runs all its rows, whole over tp, on its width slice and the outputs are summed
over tp; otherwise (Megatron-core's MoE parallel folding) each tp rank dispatches a 1/tp share of
the rows, the etp ranks gather what they received, run their width slice on all of it and
reduce-scatter the partial outputs back, and the shares' outputs are gathered over tp.

The auxiliary losses (load balancing, router z-loss, DeepSeek-V3's sequence-wise balance loss) do
not travel with the output: a pass-through autograd function adds their gradient in backward
(Megatron's MoEAuxLossAutoScaler), so every schedule (micro-batches, pipeline, recompute) trains
on them unchanged; the last values are kept on the module for reporting. The same backward
records the expert loads of each trained micro-batch, however often recompute ran the forward.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ms_llm.config.model import ModelConfig
from torch_backend.layers import MLP
from torch_backend.moe_dispatch import (CopyToTp, GatherFromEtp, GatherFromTp, ReduceFromTp, ReduceScatterToEtp,
                                        all_to_all, by_expert, share_of, share_sizes)


class StackedLinear(nn.Module):
    """`weight` (E, out, in): one nn.Linear weight per expert, stacked along dim 0."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


GROUPED_MM = hasattr(torch, "_grouped_mm")     # torch >= 2.8 (CPU too); else the padded batched matmul


class Experts(nn.Module):
    """The routed experts, stacked. Holds all E experts until expert parallelism slices dim 0.

    All local experts run together, not one by one: torch._grouped_mm over the rows' expert groups
    (torchtitan's and Megatron's grouped GEMM), or, where the build lacks it (`grouped` False) or
    the sizes break its 16-byte alignment, one batched matmul over the groups zero-padded to the
    largest (E, C, H)."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_proj = StackedLinear(experts, width, hidden)
        self.up_proj = StackedLinear(experts, width, hidden)
        self.down_proj = StackedLinear(experts, hidden, width)
        self.grouped = GROUPED_MM

    def forward(self, rows: torch.Tensor, counts: list[int], scale: torch.Tensor) -> torch.Tensor:
        """rows (N, H) sorted by local expert, counts[e] rows each, scale (N,) their routing
        weights -> (N, H) weighted outputs. The weights scale the activation before down_proj
        (Megatron's activation_func_with_probs): an (N, F) product, not an (N, H) one."""
        # Autocast does not cover _grouped_mm: cast as it casts a matmul.
        device = rows.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
        rows, scale = rows.to(dtype), scale.to(dtype)[:, None]
        w1, w3, w2 = (p.weight.to(dtype).transpose(1, 2) for p in (self.gate_proj, self.up_proj, self.down_proj))
        if self.grouped and all(n * rows.element_size() % 16 == 0 for n in w1.shape[1:]):
            offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
            rows = rows.contiguous()
            h = F.silu(torch._grouped_mm(rows, w1, offs=offs)) * torch._grouped_mm(rows, w3, offs=offs)
            out = torch._grouped_mm(h * scale, w2, offs=offs)
            if out.requires_grad:              # _grouped_mm's backward needs 16-byte strides
                out.register_hook(torch.Tensor.contiguous)
            return out
        return padded_bmm(rows, counts, scale, w1, w3, w2)


def padded_bmm(rows: torch.Tensor, counts: list[int], scale: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    """The SwiGLU experts as one batched matmul: each expert's rows go to its slot of an (E, C, H)
    zero tensor, C the largest count (padding rows cost compute, not results). w1, w3 (E, H, F),
    w2 (E, F, H); rows (N, H) sorted by expert, counts[e] rows each, scale (N, 1) -> (N, H)."""
    e, c, hidden = len(counts), max(counts, default=0), rows.shape[1]
    sizes = torch.tensor(counts, device=rows.device)
    expert = torch.repeat_interleave(torch.arange(e, device=rows.device), sizes)
    first = torch.cumsum(sizes, 0) - sizes
    slot = expert * c + torch.arange(rows.shape[0], device=rows.device) - first[expert]
    padded = rows.new_zeros(e * c, hidden).index_copy(0, slot, rows).view(e, c, hidden)
    padded_scale = scale.new_zeros(e * c, 1).index_copy(0, slot, scale).view(e, c, 1)
    h = F.silu(torch.bmm(padded, w1)) * torch.bmm(padded, w3)
    return torch.bmm(h * padded_scale, w2).view(e * c, hidden)[slot]


class AuxLoss(torch.autograd.Function):
    """Identity on `output`; backward also sends `owner.aux_scale` into `aux` (the loss is not in the
    graph of the model's output, so this is how its gradient reaches the router), and records
    the value in `owner.aux_trained` (and `load`, the expert loads, in `owner.load_trained`):
    once per backpropagated micro-batch, however often recompute ran the forward. `owner`: an
    MoE layer, or the multi-token prediction modules (torch_backend.mtp) for their loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, owner: nn.Module,
                load: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.owner, ctx.load = owner, load
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        ctx.owner.aux_trained.append(aux.detach().float())
        if ctx.load is not None:
            ctx.owner.load_trained.append(ctx.load)
        return grad, torch.full_like(aux, ctx.owner.aux_scale), None, None


def load_balancing_loss(probs: torch.Tensor, top: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's loss, top-k form (Megatron's): E * sum_e f_e * P_e, with f_e the share of
    the N*k token copies routed to e and P_e the mean router probability of e; 1.0 when balanced.
    probs (N, E) fp32, top (N, k) expert ids."""
    f = torch.bincount(top.flatten(), minlength=num_experts).float() / top.numel()
    return num_experts * (f * probs.mean(0)).sum()


def seq_aux_loss(scores: torch.Tensor, top: torch.Tensor, sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20, Megatron's seq_aux_loss): per sequence
    of T tokens, f_e = E / (k T) x #{t: e in top_k(t)} and P_e = mean_t of the scores normalised
    to sum 1 per token; the mean over sequences of sum_e f_e P_e. scores (N, E) fp32, top (N, k)."""
    (n, e), k = scores.shape, top.shape[1]
    t = n // sequences
    normalised = (scores / (scores.sum(-1, keepdim=True) + 1e-20)).view(sequences, t, e)
    chosen = torch.zeros(sequences, e, device=scores.device).scatter_add_(
        1, top.view(sequences, t * k), torch.ones(sequences, t * k, device=scores.device))
    f = chosen * (e / (k * t))
    return (f * normalised.mean(1)).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class MoE(nn.Module):
    """Router + routed experts (+ shared experts). Replaces the MLP of an MoE layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k, self.normalize = m.num_experts, m.top_k, m.normalize_top_k
        self.capacity_factor, self.aux_coeff, self.z_coeff = m.capacity_factor, m.aux_loss_coeff, m.z_loss_coeff
        self.sigmoid, self.scaling = m.score_function == "sigmoid", m.routed_scaling_factor
        self.num_groups, self.group_top_k, self.seq_coeff = m.num_groups, m.group_top_k, m.seq_aux_loss_coeff
        self.bias_update_rate = m.bias_update_rate
        self.gate = nn.Linear(cfg.hidden_size, m.num_experts, bias=False)
        if m.expert_bias:      # selection only; fp32 and checkpointed, as transformers names it
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(m.num_experts, dtype=torch.float32))
        self.experts = Experts(m.num_experts, cfg.hidden_size, cfg.expert_ffn_size)
        self.shared_experts = (MLP(cfg, width=m.shared_experts * cfg.expert_ffn_size)
                               if m.shared_experts else None)
        # Set by torch_backend.parallelize.ep: the ranks the experts are split over; the dense tp group,
        # over which this layer's rows are whole; whether each tp rank runs a share of the rows (etp != tp)
        # rather than a slice of every expert's width (etp = tp); and then the etp ranks (etp > 1).
        self.ep_group: Optional[dist.ProcessGroup] = None
        self.tp_group: Optional[dist.ProcessGroup] = None
        self.tp_shares = False
        self.etp_group: Optional[dist.ProcessGroup] = None
        self.aux_scale = 1.0                   # gradient weight of the aux losses (TrainStep: loss scale / micro-batches)
        self.last_aux = torch.zeros((), device="cpu")        # coefficient-weighted aux losses of the last forward
        self.aux_trained: list[torch.Tensor] = []     # their values, per micro-batch backpropagated since taken
        self.load_trained: list[torch.Tensor] = []    # routed copies per expert (E,), likewise (expert bias only)

    @property
    def expert_bias(self) -> Optional[torch.Tensor]:
        return getattr(self.gate, "e_score_correction_bias", None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> router logits (N, E), scores (N, E) fp32, weights (N, k) in x's dtype, expert ids (N, k)."""
        if self.sigmoid:            # DeepSeek-V3: fp32 logits, whatever the compute dtype
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), self.gate.weight.float())
            scores = torch.sigmoid(logits)
        else:
            logits = self.gate(x)
            scores = F.softmax(logits.float(), dim=-1)
        bias = self.expert_bias
        if bias is None and self.num_groups == 1:
            weights, top = torch.topk(scores, self.top_k, dim=-1)
        else:                       # the bias and the group limit steer the choice, not the weights
            choice = scores if bias is None else scores + bias
            top = torch.topk(self.limit_groups(choice), self.top_k, dim=-1)[1]
            weights = scores.gather(1, top)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, (weights * self.scaling).to(x.dtype), top

    def limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask to -inf every expert outside the token's best group_top_k groups, a group scoring the
        sum of its best top_k / group_top_k choice scores. choice (N, E); unchanged with one group."""
        if self.num_groups == 1:
            return choice
        n, e = choice.shape
        grouped = choice.view(n, self.num_groups, e // self.num_groups)
        group_scores = grouped.topk(self.top_k // self.group_top_k, dim=-1)[0].sum(-1)        # (N, G)
        best = torch.topk(group_scores, self.group_top_k, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)                                              # (N, H)
        logits, scores, weights, top = self.route(tokens)
        flat = top.flatten()                                                   # (N*k,) expert of each copy
        order = torch.argsort(flat, stable=True)                               # copies grouped by expert
        keep = self.capacity_mask(flat, order)
        if keep is not None:
            order = order[keep]
        counts = torch.bincount(flat[order], minlength=self.num_experts)
        rows = tokens[order // self.top_k]                                     # (M, H) sorted by expert
        out = self.run_experts(rows, counts, weights.flatten()[order])
        y = torch.zeros_like(tokens).index_add_(0, order // self.top_k, out.to(tokens.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        y = y.view(B, T, H)
        # Megatron balances sigmoid scores normalised per token, as softmax probabilities are.
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if self.sigmoid else scores
        aux = self.aux_coeff * load_balancing_loss(probs, top, self.num_experts) + self.z_coeff * z_loss(logits)
        if self.seq_coeff:
            aux = aux + self.seq_coeff * seq_aux_loss(scores, top, B)
        self.last_aux = aux.detach()
        load = None
        if self.expert_bias is not None:
            load = torch.bincount(flat, minlength=self.num_experts).float()
        if torch.is_grad_enabled() and (self.aux_coeff or self.z_coeff or self.seq_coeff or load is not None):
            y = AuxLoss.apply(y, aux, self, load)
        return y

    def take_aux(self, micro_batches: int) -> torch.Tensor:
        """Sum of the aux losses of the step's last `micro_batches` backward passes; resets. (The
        last ones: torch's pipeline stages also run a backward on placeholder data to infer
        gradient shapes, in their first step.)"""
        taken, self.aux_trained = self.aux_trained[-micro_batches:], []
        return torch.stack(taken).sum() if taken else torch.zeros(())

    def take_load(self, micro_batches: int) -> torch.Tensor:
        """Routed token copies per expert (E,) of the step's last `micro_batches` backward passes; resets."""
        taken, self.load_trained = self.load_trained[-micro_batches:], []
        return torch.stack(taken).sum(0) if taken else torch.zeros(self.num_experts)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): bias += rate x sign(mean load - load), in fp32.
        `load`: this layer's loads summed over every rank that routes different tokens."""
        bias = self.expert_bias
        bias += self.bias_update_rate * torch.sign(load.mean() - load).to(bias)

    def capacity_mask(self, flat: torch.Tensor, order: torch.Tensor) -> Optional[torch.Tensor]:
        """Which sorted copies an expert takes: all (None) when dropless, else the first
        ceil(capacity_factor * N*k / E) per expert in token order (GShard)."""
        if self.capacity_factor < 0:
            return None
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.num_experts)
        sorted_experts = flat[order]
        counts = torch.bincount(sorted_experts, minlength=self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[sorted_experts]
        return position < capacity

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert (counts per expert), scale their routing weights -> their
        weighted expert outputs, same order. Under tp, rows and weights are whole on every tp rank
        (their gradient is summed over tp: Megatron's copy to the tensor-parallel region). With the
        experts' width over tp, each rank computes a partial sum over its width slice of all rows,
        summed over tp (reduce from the region, around column / row parallel); with it over another
        etp group, each tp rank runs a 1/tp share of the rows and the shares are gathered."""
        if self.tp_group is not None:
            rows, scale = CopyToTp.apply(rows, self.tp_group), CopyToTp.apply(scale, self.tp_group)
        if not self.tp_shares:
            out = self.dispatch(rows, counts, scale)
            return out if self.tp_group is None else ReduceFromTp.apply(out, self.tp_group)
        tp = dist.get_world_size(self.tp_group)
        start, stop, held = share_of(counts, dist.get_rank(self.tp_group), tp)
        out = self.dispatch(rows[start:stop], held, scale[start:stop])
        return GatherFromTp.apply(out, share_sizes(rows.shape[0], tp), self.tp_group)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert -> their outputs, through the ep ranks when the experts are split."""
        if self.ep_group is None:
            return self.run_local(rows, counts, scale)
        return self.dispatch_and_run(rows, counts, scale)

    def run_local(self, rows: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """This rank's experts on rows sorted by local expert (counts (E_local,)). With an etp group, its
        ranks hold slices of the same experts' width: they gather one another's rows, run their slice
        on all of them and sum the partial outputs back onto each rank's own rows."""
        if self.etp_group is None:
            return self.experts(rows, counts.tolist(), scale)
        group, etp = self.etp_group, dist.get_world_size(self.etp_group)
        every = [torch.empty_like(counts) for _ in range(etp)]
        dist.all_gather(every, counts.contiguous(), group=group)
        every = torch.stack(every)                                            # (etp, E_local)
        sizes = every.sum(1).tolist()
        regroup = by_expert(every)
        gathered = GatherFromEtp.apply(rows, sizes, group)[regroup]
        out = self.experts(gathered, every.sum(0).tolist(), GatherFromEtp.apply(scale, sizes, group)[regroup])
        restored = torch.empty_like(out).index_copy_(0, regroup, out)
        return ReduceScatterToEtp.apply(restored, sizes, group)

    def dispatch_and_run(self, rows: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """All-to-all the rows (and their routing weights) to the ranks holding their experts, run,
        and send the results back."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = self.num_experts // ep
        # counts_in[s, e]: rows rank s sends to this rank's local expert e.
        counts_in = torch.empty(ep * local, dtype=counts.dtype, device=counts.device)
        dist.all_to_all_single(counts_in, counts, group=group)
        counts_in = counts_in.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = counts_in.sum(1).tolist()
        received = all_to_all(rows, send, recv, group)                        # grouped by (source, expert)
        received_scale = all_to_all(scale, send, recv, group)
        # Regroup by (expert, source) so each local expert's rows are contiguous, and back after.
        regroup = by_expert(counts_in)
        out = self.run_local(received[regroup], counts_in.sum(0), received_scale[regroup])
        restored = torch.empty_like(out).index_copy_(0, regroup, out)
        return all_to_all(restored, recv, send, group)
