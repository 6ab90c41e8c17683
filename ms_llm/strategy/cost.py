"""Memory, communication and step-time model of a ModelPlan on a device.

Model states follow ZeRO (Rajbhandari et al.): with psi parameters, 2-byte params and
grads and K bytes of optimizer state per parameter (K = 12 for mixed-precision Adam:
fp32 master, m, v), a rank holds (2+2+K)psi at stage 0, 2psi+2psi+K psi/Nd at stage 1,
2psi+(2+K)psi/Nd at stage 2 and (2+2+K)psi/Nd at stage 3. Activations are counted per
saved tensor of a decoder layer in the manner of Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models": tensors inside the tp region are split by tp,
norm inputs/outputs only with sequence parallel, everything by cp. Multi-latent attention keeps
its latents whole on every tp rank and its K/V expanded per head; an MoE layer keeps its top_k
experts' activations. Compute is priced per pipeline rank (shape.stage_flops_per_token): the
rank holding lm_head and the MTP modules may set the pace.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, Union

from ms_llm.config.model import DTYPE_BYTES, ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.devices import DEVICES, DeviceSpec
from ms_llm.strategy.ir import CP_ALGORITHMS, ContextParallelSpec, ParallelStrategy
from ms_llm.strategy.plan import ModelPlan
# CostShape and its two builders live in shape.py; the search and the tests import them from here.
from ms_llm.strategy.shape import CostShape, StageShape, cost_shape, mtp_embedding_copy, shape_of, stage_flops_per_token

ADAM_STATE_BYTES = 8       # m and v in fp32
_CP_SPECS = {a: ContextParallelSpec(algorithm=a) for a in CP_ALGORITHMS}
T = TypeVar("T")


def zero_model_state_bytes(psi: float, stage: int, nd: int, k: float = 12,
                           param_bytes: float = 2, grad_bytes: float = 2) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank for ZeRO `stage` over `nd` ranks."""
    params, grads, optim = param_bytes * psi, grad_bytes * psi, k * psi
    if stage >= 1:
        optim /= nd
    if stage >= 2:
        grads /= nd
    if stage >= 3:
        params /= nd
    return params, grads, optim


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device of the busiest pipeline stage."""
    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    zero3_gather: float
    host_offload: float          # bytes moved to host memory (not counted in total)
    in_flight_micro_batches: float
    experts: float = 0.0         # of params + grads + optimizer, the routed experts' (after ep, etp, edp)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.logits + self.zero3_gather

    def components(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits, "zero3_gather": self.zero3_gather}


@dataclass(frozen=True)
class CommVolume:
    """Bytes each rank sends per step, by mesh axis, and the collective that carries them."""
    bytes_by_axis: dict[str, float] = field(default_factory=dict)
    collective_by_axis: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepEstimate:
    memory: MemoryBreakdown
    comm: CommVolume
    compute_s: float
    bubble_s: float
    exposed_comm_s: dict[str, float]
    step_s: float
    tokens_per_step: int
    mfu: float
    fits: bool
    world_size: int

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_s / self.world_size if self.step_s else 0.0


def _shape(plan: Union[ModelPlan, CostShape]) -> CostShape:
    return plan if isinstance(plan, CostShape) else cost_shape(plan)


def replaced(obj: T, **changes: object) -> T:
    """dataclasses.replace without running the class's __init__ and checks again: for copies of a
    checked ParallelStrategy or CostShape that change a field no check reads (the context-parallel
    algorithm, the recompute policy), which a search makes tens of thousands of times."""
    unknown = changes.keys() - obj.__dataclass_fields__.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new


def _optimizer_bytes_per_param(plan: CostShape) -> float:
    prec = plan.strategy.precision
    # An offloaded optimizer steps on the host, so it keeps its own copy of the weights there.
    keep_master = prec.master_dtype != prec.param_dtype or plan.strategy.offload.optimizer
    master = DTYPE_BYTES[prec.master_dtype] if keep_master else 0
    states = ADAM_STATE_BYTES if plan.train.optimizer.name == "adamw" else 0
    return master + states


def attention_widths(m: ModelConfig) -> tuple[int, int, int, int]:
    """Per-token widths of q, k, v and the attention output over all heads. MLA expands its latent
    into per-head keys (qk_nope + the shared qk_rope) and values (v_head_dim) for attention."""
    if m.mla is None:
        return m.q_dim, m.kv_dim, m.kv_dim, m.q_dim
    return m.q_dim, m.q_dim, m.attn_out_dim, m.attn_out_dim


def latent_width(m: ModelConfig) -> int:
    """MLA's latents kept per token on every tp rank: each low-rank path's down-projection output
    (the latent norm's input) and the latent norm's output (the up-projection's input)."""
    a = m.mla
    if a is None:
        return 0
    query = 2 * a.q_lora_rank if a.q_lora_rank is not None else 0
    return query + (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank


def activation_bytes_per_token_layer(plan: CostShape, mode: str) -> float:
    """Bytes one decoder layer keeps for backward per (local) token."""
    m, s = plan.model, plan.strategy
    tp = s.tp
    h, f = m.hidden_size, m.ffn_hidden_size
    q, k, v, out = attention_widths(m)
    dispatch = 0.0
    if m.moe is not None:
        # An MoE layer (the largest): top_k expert MLPs per token plus the shared experts, and the
        # token copies sorted by expert, sent and received (dispatch and combine buffers).
        f = m.moe.top_k * m.expert_ffn_size + m.moe.shared_experts * m.expert_ffn_size
        dispatch = 4 * m.moe.top_k * h
    act = DTYPE_BYTES[s.precision.compute_dtype]
    norm_io = 4 * h / (tp if s.sequence_parallel else 1)       # attn/mlp norm inputs and outputs
    if mode == "full":
        return act * h / (tp if s.sequence_parallel else 1)    # the layer input only
    # K/V as attention keeps them: all-gather context parallelism keeps the gathered K/V, and its
    # (T_local, T) position mask, which SDPA keeps as a float copy per layer (shared by the
    # micro-batch's sequences and the tp ranks' heads: T / micro-batch per local token).
    allgather = s.cp > 1 and keeps_gathered_kv(cp_algorithm(plan))
    kv_kept = (k + v) * s.cp if allgather else k + v
    mask = plan.train.seq_len / plan.train.micro_batch_size if allgather else 0.0
    inside = (q + kv_kept + out + 4 * f + dispatch) / tp + mask   # q, k, v, attn out, gate/up/silu/product
    inside += (q + k) / tp * m.qk_norm                         # q, k norm outputs (Qwen3)
    inside += latent_width(m)                                  # MLA's latents, whole on every tp rank
    if mode == "selective":
        inside -= 2 * f / tp                                   # silu output and product are recomputed
    return act * (norm_io + inside)


def keeps_gathered_kv(algorithm: str) -> bool:
    """Whether attention under this context-parallel algorithm keeps the whole sequence's K/V: the
    only way the algorithm changes the memory model (the cp algorithm pick shares the rest)."""
    return algorithm == "allgather"


def _mtp_activation_bytes_per_token(plan: CostShape, per_token_layer: dict[str, float]) -> float:
    """Bytes the MTP modules keep per (local) token: each one's decoder layer (recomputed under the
    policy when it covers every layer) plus enorm's input, eh_proj's input (2h), and its final norm's
    input and output."""
    m, s = plan.model, plan.strategy
    mode = s.recompute.policy if s.recompute.num_layers == -1 else "none"
    extra = DTYPE_BYTES[s.precision.compute_dtype] * 5 * m.hidden_size / (s.tp if s.sequence_parallel else 1)
    return m.mtp_layers * (per_token_layer[mode] + extra)


def _in_flight(plan: CostShape, stage: int) -> float:
    s = plan.strategy
    pp, m, v = s.pp, plan.micro_batches, s.pipeline.virtual_stages
    if pp == 1:
        return 1.0
    schedule = s.pipeline.schedule
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        # Korthikanti et al.: stage 0 holds pp * (1 + (pp-1)/(pp*v)) micro-batches' worth of its
        # layers; never more than the m micro-batches a step has.
        return min(float(m), (pp - stage) * (1 + (pp - 1) / (pp * v)))
    return float(min(m, pp - stage))


class _PerTokenLayer(dict):
    """activation_bytes_per_token_layer by recompute mode, each counted the first time a stage asks."""

    def __init__(self, shape: CostShape) -> None:
        super().__init__()
        self.shape = shape

    def __missing__(self, mode: str) -> float:
        self[mode] = value = activation_bytes_per_token_layer(self.shape, mode)
        return value


def memory(plan: Union[ModelPlan, CostShape]) -> MemoryBreakdown:
    """Per-device memory of the busiest stage."""
    shape = _shape(plan)
    per_token_layer = _PerTokenLayer(shape)
    best = previous = None
    for stage, st in enumerate(shape.stages):
        # A later stage holds no more micro-batches in flight (_in_flight), so one no bigger than the
        # stage before it cannot be busier (nor, on a tie, come first): price only the others.
        skip = previous is not None and _no_bigger(st, previous)
        previous = st
        if skip:
            continue
        mb = _stage_memory(shape, stage, per_token_layer)
        if best is None or mb.total > best.total:
            best = mb
    return best


def _no_bigger(st: StageShape, than: StageShape) -> bool:
    """Whether every term of _stage_memory but the micro-batches in flight is at most `than`'s:
    no more dense or expert parameters, the same layers' recompute modes and MTP modules (so the
    same activations per micro-batch and ZeRO-3 gather), a head only if `than` has one."""
    return (st.recompute == than.recompute and st.mtp_layers == than.mtp_layers
            and (st.moe_layers > 0) == (than.moe_layers > 0) and st.has_head <= than.has_head
            and st.expert_params <= than.expert_params
            and st.params - st.expert_params <= than.params - than.expert_params)


def stage_memory(plan: Union[ModelPlan, CostShape], stage: int) -> MemoryBreakdown:
    """Per-device memory of one pipeline rank."""
    shape = _shape(plan)
    return _stage_memory(shape, stage, _PerTokenLayer(shape))


def _stage_memory(plan: CostShape, stage: int, per_token_layer: dict[str, float]) -> MemoryBreakdown:
    s, m, t = plan.strategy, plan.model, plan.train
    st = plan.stages[stage]
    psi = st.params - st.expert_params
    pbytes = DTYPE_BYTES[s.precision.param_dtype]
    nd = plan.zero.group_size
    k = _optimizer_bytes_per_param(plan)
    edp = s.edp
    params, grads, optim = zero_model_state_bytes(psi, s.zero.stage, nd, k, pbytes, pbytes)
    # Routed experts: split over ep and etp already, replicated over edp; ZeRO shards them over edp at
    # the job's stage, optimizer states, then gradients, then weights (ms_llm.strategy.plan._expert_zero).
    routed = zero_model_state_bytes(st.expert_params, s.zero.stage, edp, k, pbytes, pbytes)
    experts = sum(routed)
    params, grads, optim = params + routed[0], grads + routed[1], optim + routed[2]
    host = 0.0
    if s.offload.optimizer:
        host += optim
        optim = 0.0
    gather = 0.0
    if s.zero.stage == 3:
        # One layer's parameters unsharded for compute plus the next one's prefetched: its dense ones
        # over tp, its routed experts over ep x etp (gathered over edp; whole already when edp is 1).
        every = 3 * m.moe.num_experts * m.hidden_size * m.expert_ffn_size if plan.moe_layers_of(st) else 0
        local = every / (s.ep * s.etp) if edp > 1 else 0
        gather = 2 * ((m.layer_param_count() - every) / s.tp + local) * pbytes
        if s.offload.params:
            host += params
            params = 0.0
    tokens = t.micro_batch_size * t.seq_len / s.cp
    per_mb = sum(n * per_token_layer[mode] for mode, n in st.recompute) * tokens
    if st.mtp_layers:
        per_mb += _mtp_activation_bytes_per_token(plan, per_token_layer) * tokens
    if any(mode == "full" for mode, _ in st.recompute):
        per_mb_working = per_token_layer["none"] * tokens
    else:
        per_mb_working = 0.0
    in_flight = _in_flight(plan, stage)
    activations = per_mb * in_flight + per_mb_working
    logits = 0.0
    if st.has_head:
        # fp32 logits for the loss plus their gradient, vocab-parallel over tp: the main head's and
        # each MTP module's.
        logits = 2 * 4 * tokens * m.vocab_size / s.tp * (1 + st.mtp_layers)
    return MemoryBreakdown(stage, params, grads, optim, activations, logits, gather, host, in_flight, experts)


def communication(plan: Union[ModelPlan, CostShape]) -> CommVolume:
    plan = _shape(plan)
    s, m, t = plan.strategy, plan.model, plan.train
    act = DTYPE_BYTES[s.precision.compute_dtype]
    pbytes = DTYPE_BYTES[s.precision.param_dtype]
    gbytes = DTYPE_BYTES[s.precision.grad_reduce_dtype]
    mb = plan.micro_batches
    tokens = t.micro_batch_size * t.seq_len / s.cp                  # per micro-batch per rank
    layers = max(st.layers + st.mtp_layers for st in plan.stages)
    # The dense parameters' gradients are reduced over dp x cp, the routed experts' over edp (the ranks
    # holding the same expert shard; none when edp is 1), each at the job's ZeRO stage
    # (ms_llm.strategy.plan._expert_zero). Each axis is charged for its busiest pipeline rank.
    dense = max(st.params - st.expert_params for st in plan.stages)
    experts = max(st.expert_params for st in plan.stages)
    vol: dict[str, float] = {}
    kind: dict[str, str] = {}

    for axis, n, psi in (("dp_cp", s.dp * s.cp, dense), ("edp", s.edp, experts)):
        if n > 1 and psi:
            vol[axis], kind[axis] = _grad_sync_volume(psi * gbytes, psi * pbytes, n, s.zero.stage, mb)
    if "dp_cp" in vol and plan.zero.replicate_size > 1 and s.zero.stage:
        r = plan.zero.replicate_size
        vol["dp_cp"] += 2 * (r - 1) / r * dense * gbytes / plan.zero.group_size
        kind["dp_cp"] += " + all-reduce across replicas"
    if s.tp > 1:
        a = tokens * m.hidden_size * act
        per_layer = 4 + (2 if plan.recomputed_layers("full") else 0)
        vol["tp"] = per_layer * layers * mb * 2 * (s.tp - 1) / s.tp * a
        kind["tp"] = "all-gather + reduce-scatter (sequence parallel)" if s.sequence_parallel else "all-reduce"
    if s.cp > 1:
        vol["cp"], kind["cp"] = _cp_volume(plan)
    if s.pp > 1:
        boundary = tokens * m.hidden_size * act / (s.tp if s.sequence_parallel else 1)
        vol["pp"] = 2 * boundary * mb * s.pipeline.virtual_stages
        kind["pp"] = "p2p send/recv of activations and their gradients"
        # The MTP modules' embedding copy on a rank past the first (which holds the embedding): its
        # gradient is summed with the first rank's once a step.
        copy = mtp_embedding_copy(m, s, False, any(st.mtp_layers for st in plan.stages[1:]))
        if copy:
            vol["pp"] += copy * gbytes
            kind["pp"] += " + all-reduce of the MTP embedding copy's gradient"
    if m.moe is not None:
        for axis, (nbytes, what) in expert_volume(plan, tokens, act).items():
            vol[axis], kind[axis] = nbytes, what
    return CommVolume(vol, kind)


def _grad_sync_volume(G: float, P: float, n: int, stage: int, mb: int) -> tuple[float, str]:
    """Bytes a rank sends per step to reduce `G` bytes of gradients (and, under ZeRO, gather `P` bytes
    of parameters) over `n` ranks by ring collectives at ZeRO `stage` with `mb` micro-batches."""
    ring = (n - 1) / n
    if stage == 0:
        return 2 * ring * G, "all-reduce grads"
    if stage == 1:
        return ring * (G + P), "reduce-scatter grads + all-gather params"
    if stage == 2:
        # No full gradient buffer to accumulate into: each micro-batch's gradients are reduce-scattered.
        return ring * (mb * G + P), "reduce-scatter grads per micro-batch + all-gather params"
    # Parameters are gathered again for every micro-batch's forward and backward.
    return ring * mb * (G + 2 * P), "all-gather params (fwd, bwd) + reduce-scatter grads, per micro-batch"


def expert_volume(plan: CostShape, tokens: float, act: float) -> dict[str, tuple[float, str]]:
    """Bytes a rank sends per step to run the routed experts of its MoE layers, by expert mesh axis,
    as torch_backend.moe dispatches: each token copy goes to its expert's rank and back, forward and
    again in backward. With etp = tp a rank sends all its copies (whole over tp) to the ep ranks at its
    tp position; otherwise each tp rank sends a 1/tp share, and the etp ranks all-gather what they
    received and reduce-scatter their partial outputs back (Megatron-core's folded dispatcher).
    `tokens`: a rank's tokens per micro-batch."""
    s, m = plan.strategy, plan.model
    passes = max(plan.moe_layers_of(st) for st in plan.stages) * plan.micro_batches
    copies = tokens * m.moe.top_k * m.hidden_size * act / (1 if s.etp == s.tp else s.tp)
    out = {}
    if s.ep > 1:
        out["ep"] = 4 * copies * (s.ep - 1) / s.ep * passes, "all-to-all dispatch/combine"
    if s.etp > 1 and s.etp != s.tp:
        out["etp"] = 4 * copies * (s.etp - 1) * passes, "all-gather dispatched tokens + reduce-scatter outputs"
    return out


def _cp_volume(plan: CostShape) -> tuple[float, str]:
    """Bytes a rank sends over cp per step (a forward and backward pass of its busiest pipeline rank's
    layers per micro-batch), and what carries them."""
    s, m, t = plan.strategy, plan.model, plan.train
    act = DTYPE_BYTES[s.precision.compute_dtype]
    tokens = t.micro_batch_size * t.seq_len / s.cp                  # per micro-batch per rank
    layer_passes = max(st.layers + st.mtp_layers for st in plan.stages) * plan.micro_batches
    cp, algorithm = s.cp, cp_algorithm(plan)
    q_width, k_width, v_width, out_width = attention_widths(m)
    kv = tokens * (k_width + v_width) / s.tp * act         # this rank's K and V
    if algorithm == "ring":
        # cp-1 hops of the local block forward; backward: K/V again and dK/dV (cp hops).
        return 3 * kv * (cp - 1) * layer_passes, "ring p2p of K/V (fwd), K/V and dK/dV (bwd)"
    if algorithm == "allgather":
        return 2 * kv * (cp - 1) * layer_passes, "all-gather K/V (fwd), reduce-scatter dK/dV (bwd)"
    # ulysses: q, k, v in and the output back, forward and backward; (cp-1)/cp of each leaves.
    heads = m.num_heads // s.tp
    kv_heads = m.num_kv_heads // s.tp
    kv_heads = kv_heads if kv_heads % cp == 0 else heads    # GQA heads repeated when cp does not divide them
    per_head = (q_width + out_width) / m.num_heads * heads + (k_width + v_width) / m.num_kv_heads * kv_heads
    per_token = per_head * act
    return 2 * per_token * tokens * (cp - 1) / cp * layer_passes, "4 all-to-alls per layer (fwd and bwd)"


def cp_algorithm(plan: Union[ModelPlan, CostShape], device: DeviceSpec = DEVICES["h100"],
                 backend_runs: tuple[str, ...] = CP_ALGORITHMS) -> str:
    """The strategy's context-parallel algorithm; 'auto' = the one of the lowest estimated step
    time on `device` among those the model allows and the backend runs, the first of
    `backend_runs` on a tie."""
    shape = _shape(plan)
    s = shape.strategy
    chosen = s.context_parallel.algorithm
    if chosen != "auto" or s.cp == 1:
        return backend_runs[0] if chosen == "auto" else chosen
    return priced_cp_algorithm(shape, device, backend_runs)[0]


def priced_cp_algorithm(shape: CostShape, device: DeviceSpec, backend_runs: tuple[str, ...] = CP_ALGORITHMS
                        ) -> tuple[str, Union[StepEstimate, None]]:
    """cp_algorithm's 'auto' pick for a shape with cp > 1, and the shape's estimate under it (None when
    no algorithm applies), which the search keeps rather than pricing it again. Memory first: while
    one algorithm fits, those that do not can never win, so their step time is not priced."""
    s = shape.strategy
    options = []
    memories: dict[bool, MemoryBreakdown] = {}
    allowed = cp_algorithms(shape.model, s, shape.train)
    for algorithm in (a for a in backend_runs if a in allowed):
        priced = replaced(shape, strategy=replaced(s, context_parallel=_CP_SPECS[algorithm]))
        gathered = keeps_gathered_kv(algorithm)
        if gathered not in memories:
            memories[gathered] = memory(priced)
        options.append((algorithm, priced, memories[gathered]))
    any_fits = any(mem.total <= device.memory_bytes for _, _, mem in options)
    best = comm = None
    time = _compute_time(shape, device)           # the algorithms share it, and all but cp's traffic
    for algorithm, priced, mem in options:
        if any_fits and mem.total > device.memory_bytes:
            continue
        if comm is None:
            comm = communication(priced)
        else:
            volume = dict(comm.bytes_by_axis)
            collective = dict(comm.collective_by_axis)
            volume["cp"], collective["cp"] = _cp_volume(priced)
            comm = CommVolume(volume, collective)
        est = _estimate(priced, device, mem, comm, time)
        key = (not est.fits, est.step_s, est.memory.total)
        if best is None or key < best[0]:
            best = (key, algorithm, est)
    return (best[1], best[2]) if best else (backend_runs[0], None)


def cp_algorithms(model: ModelConfig, s: ParallelStrategy, train: TrainConfig) -> tuple[str, ...]:
    """The algorithms validate() accepts for this model, strategy and sequence length."""
    out = []
    if train.seq_len % (2 * s.cp) == 0:
        out += ["ring", "allgather"]
    if train.seq_len % s.cp == 0 and model.num_heads % (s.tp * s.cp) == 0:
        out.append("ulysses")
    return tuple(out)


def _group_bandwidth(plan: CostShape, axis: str, device: DeviceSpec) -> float:
    """Intra-node links if the whole group fits in one node, else the network."""
    s = plan.strategy
    # Ranks the group spans: the ranks inside one of its members (the mesh is tp innermost, then cp,
    # dp, pp; the experts' etp, ep, edp) times its size.
    if axis == "tp":
        span = s.tp
    elif axis == "cp":
        span = s.tp * s.cp
    elif axis == "dp_cp":
        span = s.tp * (s.dp * s.cp)
    elif axis == "edp":
        span = s.ep * s.etp * s.edp
    elif axis == "ep":
        span = s.etp * s.ep
    elif axis == "etp":
        span = s.etp
    elif axis == "pp":
        span = s.tp * s.cp * s.dp * 2
    else:
        raise KeyError(axis)
    return device.intra_node_bw if span <= device.devices_per_node else device.inter_node_bw


def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """ModelConfig.flops_per_token plus each MTP module's own pass through lm_head (its logits),
    which that count leaves out."""
    return _work_per_token(m, seq_len)[0]


# (id(model), seq_len) -> (model, _work_per_token): looked up by identity, since hashing a ModelConfig
# costs as much as the rest of an estimate's compute time; the entry keeps its model, so the id stays its own.
_WORK: dict[tuple[int, int], tuple[ModelConfig, tuple[float, float]]] = {}


def _work_per_token(m: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(model_flops_per_token, attention's share of ModelConfig.flops_per_token): a sum over the layers
    that every strategy of a search shares, so it is counted once per model and sequence length."""
    hit = _WORK.get((id(m), seq_len))
    if hit is None or hit[0] is not m:
        flops = m.flops_per_token(seq_len)
        work = flops + 6.0 * m.vocab_size * m.hidden_size * m.mtp_layers, 6.0 * m.num_layers * m.hidden_size * seq_len / flops
        if len(_WORK) >= 64:
            _WORK.clear()
        hit = _WORK[(id(m), seq_len)] = (m, work)
    return hit[1]


class _ComputeTime(NamedTuple):
    tokens_per_step: int
    model_flops: float
    attention_share: float
    compute: float                     # seconds
    bubble: float                      # seconds


def _compute_time(plan: CostShape, device: DeviceSpec) -> _ComputeTime:
    """A step's compute and pipeline bubble: what the memory and traffic of a shape (its ZeRO stage,
    its cp algorithm) do not change."""
    s, m, t = plan.strategy, plan.model, plan.train
    tokens_per_step = t.global_batch_size * t.seq_len
    flops_per_token, attention_share = _work_per_token(m, t.seq_len)
    model_flops = flops_per_token * tokens_per_step
    recomputed = dict.fromkeys(("full", "selective"), 0)
    for st in plan.stages:
        for mode, n in st.recompute:
            if mode in recomputed:
                recomputed[mode] += n
    n_full = recomputed["full"] / m.num_layers
    n_sel = recomputed["selective"] / m.num_layers
    recompute_factor = 1 + n_full / 3 + n_sel * attention_share / 3
    # The pipeline runs at the pace of its busiest rank: the one with lm_head and the MTP modules
    # unless the layer split makes up for them (1 when pp = 1).
    per_stage = stage_flops_per_token(plan)
    imbalance = s.pp * max(per_stage) / sum(per_stage)
    flops_per_rank = model_flops * recompute_factor / plan.world_size * imbalance
    compute = flops_per_rank / (device.peak_flops * device.matmul_efficiency)
    pp, mb, v = s.pp, plan.micro_batches, s.pipeline.virtual_stages
    bubble_fraction = 0.0
    if pp > 1:
        bubble_fraction = (pp - 1) / (mb * (v if s.pipeline.schedule == "interleaved_1f1b" else 1))
        if s.pipeline.schedule == "zero_bubble":
            bubble_fraction /= 3
        elif s.pipeline.schedule == "zbv":
            bubble_fraction /= 6
    return _ComputeTime(tokens_per_step, model_flops, attention_share, compute, compute * bubble_fraction)


def estimate(plan: Union[ModelPlan, CostShape], device: DeviceSpec,
             mem: Union[MemoryBreakdown, None] = None) -> StepEstimate:
    """`mem`: memory(plan), when the caller has it already (the search checks the fit first)."""
    plan = _shape(plan)
    mem = memory(plan) if mem is None else mem
    return _estimate(plan, device, mem, communication(plan), _compute_time(plan, device))


def _estimate(plan: CostShape, device: DeviceSpec, mem: MemoryBreakdown, comm: CommVolume,
              time: _ComputeTime) -> StepEstimate:
    s = plan.strategy
    tokens_per_step, model_flops, attention_share, compute, bubble = time
    exposed = {}
    # The gradient reductions (dense over dp x cp, then experts over edp) share one window under backward.
    overlap = 0.8 * compute * (1.0 if s.zero.stage == 3 else 2 / 3)
    for axis, nbytes in comm.bytes_by_axis.items():
        seconds = nbytes / _group_bandwidth(plan, axis, device)
        if axis in ("dp_cp", "edp"):
            hidden = min(seconds, overlap)
            seconds, overlap = seconds - hidden, overlap - hidden
        elif axis == "cp" and cp_algorithm(plan) == "ring":
            # Each hop's transfer runs under the previous block's attention.
            seconds = max(0.0, seconds - 0.5 * compute * attention_share)
        exposed[axis] = seconds
    if s.offload.optimizer:
        exposed["host"] = 2 * mem.host_offload / 50e9      # PCIe round trip of the offloaded states
    step = compute + bubble + sum(exposed.values())
    mfu = model_flops / (step * plan.world_size * device.peak_flops) if step else 0.0
    return StepEstimate(mem, comm, compute, bubble, exposed, step, tokens_per_step, mfu,
                        mem.total <= device.memory_bytes, plan.world_size)
