"""MindFormers itself is the oracle for the MindSpore lowering.

tests/helpers/ms_oracle_probe.py builds MindFormers 2.1's real LlamaForCausalLM for every config below
(in one subprocess, PYTHONPATH=.oracles) and reads each primitive's shard strategy. The same
MindFormers parallel config goes through ms_llm's own converter (ms_llm/convert/mindformers/read.py)
to a ModelPlan and lower(); every primitive of ours that has a MindFormers counterpart is
compared with it. Strategies are compared by what they mean, not how they are spelled: each
is expanded to the block of every dimension each rank of the stage holds (a split tuple uses
MindSpore's default device matrix, replicas innermost; a Layout its own matrix), so a tuple
and a Layout that place the same data on the same ranks are equal, and a different rank
order is not.

Where MindFormers chooses differently, CHOICES names the configs, the ops and the reason we
keep ours; an op listed there whose strategies turn out equal fails too, so the list cannot go
stale. No difference found was a bug of ours; flash attention was missing and is now lowered.
The MoE cases (MindFormers' moe_config with expert_parallel) and where the MoE layers differ in
structure are in ms_oracle_moe.py.

DeepSeek-class models are compared with MindFormers 2.1's own DeepSeek-V3 training graph
(parallel_core's TrainingDeepseekV3ForCausalLM). It is built, never compiled, with the real degrees
by ms_oracle_deepseek_probe.py (its rank and group questions answered as rank 0 of the config), and
what is read is each primitive's shard() from the built cells: Layouts over its (dp, cp, tp) and MoE
(dp_ex_ep, ep) device matrices. Against a Layout our side is the TensorLayout its strategy was
computed from (OpShard.layouts), what each rank holds whatever form MindSpore is given. Its
primitives, the views that line them up with ours and what has no counterpart are in
ms_oracle_deepseek.py. Four configs: dp2 x tp2 with sequence parallel and ep2,
dp4 x ep4, the same dp2 x tp2 x ep2 over two pipeline stages (where MTP must sit with lm_head on the
last), and dp2 x cp2 x ep2; DEEPSEEK_CHOICES names where MindFormers chooses otherwise. Three differences
found were ours and are fixed: the plan kept the MLA latents whole over tp under sequence parallel
(Megatron-core and MindFormers compute them on each rank's sequence chunk), the router ran on
tokens gathered over tp under sequence parallel (both route each rank's own chunk), and the routed
experts could not fold over tp: MindFormers 2.x keeps each expert whole with ep innermost over
(dp*tp/ep, ep), which the converter now reads as etp 1 (expert parallel folding) and the plan lays out
the same way.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import math
import operator
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

import ms_oracle_deepseek
import ms_oracle_moe
from ms_llm.convert.common import ReadOptions
from ms_llm.convert.mindformers.read import read
from ms_llm.mindspore.lower import lower, parallel_optimizer_plan
from ms_llm.mindspore.op_strategy import LayoutStrategy, OpShard, as_layout, whole_over
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import EXPERT_KINDS, plan

pytestmark = pytest.mark.mindspore

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"
PROBE = Path(__file__).parents[1] / "helpers" / "ms_oracle_probe.py"
DEEPSEEK_PROBE = Path(__file__).parents[1] / "helpers" / "ms_oracle_deepseek_probe.py"

MODEL = {"num_layers": 2, "hidden_size": 256, "num_heads": 8, "vocab_size": 512, "seq_length": 64,
         "intermediate_size": 512, "compute_dtype": "float32", "param_init_type": "float32"}

# name -> (MindFormers parallel_config, model_config overrides). fused_rms_norm=False builds the
# decomposed RMSNorm (square, mean, add, rsqrt, mul, mul2), compared one primitive to one.
CASES = {
    "dp8_llama2_7b": ({"data_parallel": 8, "vocab_emb_dp": True}, {}),
    "dp2_mp4": ({"data_parallel": 2, "model_parallel": 4, "vocab_emb_dp": False}, {"fused_rms_norm": False}),
    "dp2_mp4_vocab_emb_dp": ({"data_parallel": 2, "model_parallel": 4, "vocab_emb_dp": True}, {}),
    "dp2_mp4_sp_pp2_llama2_70b": ({"data_parallel": 2, "model_parallel": 4, "use_seq_parallel": True,
                                   "pipeline_stage": 2, "micro_batch_num": 2, "vocab_emb_dp": False},
                                  {"fused_rms_norm": False}),
    "dp4_mp2_gqa_rope_slice": ({"data_parallel": 4, "model_parallel": 2, "vocab_emb_dp": False},
                               {"n_kv_heads": 4, "use_rope_slice": True, "fused_rms_norm": False}),
    "dp2_mp2_sp_gqa_flash": ({"data_parallel": 2, "model_parallel": 2, "use_seq_parallel": True,
                              "vocab_emb_dp": False}, {"n_kv_heads": 2, "use_flash_attention": True}),
    "dp4_mp2_flash_pp2": ({"data_parallel": 4, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 4,
                           "vocab_emb_dp": False}, {"use_flash_attention": True}),
    "dp2_mp2_cp2_flash_gqa": ({"data_parallel": 2, "model_parallel": 2, "context_parallel": 2,
                               "context_parallel_algo": "colossalai_cp", "vocab_emb_dp": False},
                              {"n_kv_heads": 4, "use_flash_attention": True, "fused_rms_norm": False}),
    "dp1_mp2_cp4_flash": ({"data_parallel": 1, "model_parallel": 2, "context_parallel": 4, "vocab_emb_dp": True},
                          {"use_flash_attention": True}),
    "dp2_mp2_cp2_sp_flash": ({"data_parallel": 2, "model_parallel": 2, "context_parallel": 2,
                              "use_seq_parallel": True, "vocab_emb_dp": False},
                             {"use_flash_attention": True, "fused_rms_norm": False}),
    "dp2_mp2_cp2_ulysses_flash_gqa": ({"data_parallel": 2, "model_parallel": 2, "context_parallel": 2,
                                       "context_parallel_algo": "ulysses_cp", "vocab_emb_dp": False},
                                      {"n_kv_heads": 4, "use_flash_attention": True, "fused_rms_norm": False}),
    "dp1_mp2_cp4_ulysses_flash": ({"data_parallel": 1, "model_parallel": 2, "context_parallel": 4,
                                   "context_parallel_algo": "ulysses_cp", "vocab_emb_dp": True},
                                  {"use_flash_attention": True}),
    **ms_oracle_moe.CASES,
    "dp2_mp2_cp2_ring_flash_gqa": ({"data_parallel": 2, "model_parallel": 2, "context_parallel": 2,
                                    "vocab_emb_dp": False},
                                   {"n_kv_heads": 4, "use_flash_attention": True, "use_ring_attention": True,
                                    "fused_rms_norm": False}),
}
# The cp algorithm is what ms_llm's MindFormers converter reads: context_parallel_algo colossalai_cp
# (FlashAttention q split on the sequence over cp, k/v whole) is allgather, ulysses_cp (heads over
# cp*mp) ulysses, model_config.use_ring_attention (k/v split like q, no mask) ring.


def _degrees(parallel: dict) -> tuple[int, int, int, int]:
    return (parallel.get("data_parallel", 1), parallel.get("model_parallel", 1),
            parallel.get("context_parallel", 1), parallel.get("pipeline_stage", 1))


def _devices(parallel: dict) -> int:
    return math.prod(_degrees(parallel))


# ---- strategies as rank -> block maps -----------------------------------------------------

class Blocks:
    """Which block of each dimension every rank of a stage holds: the meaning of a strategy."""

    def __init__(self, splits: tuple[int, ...], owners: tuple[tuple[int, ...], ...]):
        self.splits, self.owners = splits, owners

    @classmethod
    def of(cls, strategy, devices: int, first=None, align: tuple | None = None) -> "Blocks":
        """`first`/`align`: a split tuple that is not its op's first input lives in the device matrix
        MindSpore builds from the first input's tuple; align[d] is the first input's dim that dim d
        of this one follows when split (None: never split)."""
        if align is not None and not isinstance(strategy, (dict, LayoutStrategy)):
            splits = tuple(first)
            matrix = splits + (devices // math.prod(splits),)
            if any(strategy[d] not in (1, 1 if a is None else matrix[a]) for d, a in enumerate(align)):
                raise AssertionError(f"{tuple(strategy)} does not follow the op's first input {splits}")
            axes = [[a] if a is not None and strategy[d] > 1 else [] for d, a in enumerate(align)]
            return cls._expand(matrix, axes, devices)
        if isinstance(strategy, LayoutStrategy):
            matrix = strategy.dev_matrix
            axes = [[strategy.names.index(a) for a in dim] for dim in strategy.dims]
        elif isinstance(strategy, dict):                      # MindFormers' Layout, as the probe wrote it
            matrix = tuple(strategy["device_matrix"])
            n = len(matrix)
            axes = [[n - 1 - k for k in (t if isinstance(t, (list, tuple)) else [t]) if k != -1]
                    for t in strategy["tensor_map"]]
        else:                                                 # split tuple: replicas innermost
            splits = tuple(strategy)
            used = math.prod(splits)
            if devices % used:
                raise AssertionError(f"strategy {splits} does not divide {devices} devices")
            matrix = splits + (devices // used,)
            axes = [[d] for d in range(len(splits))]
        return cls._expand(matrix, axes, devices)

    @classmethod
    def _expand(cls, matrix: tuple[int, ...], axes: list[list[int]], devices: int) -> "Blocks":
        """Ranks row-major over the device matrix; dim d's block combines its axes, major first."""
        if math.prod(matrix) != devices:
            raise AssertionError(f"device matrix {matrix} is not {devices} devices")
        owners = []
        for coords in itertools.product(*(range(m) for m in matrix)):
            block = []
            for dim_axes in axes:
                index = 0
                for a in dim_axes:
                    index = index * matrix[a] + coords[a]
                block.append(index)
            owners.append(tuple(block))
        splits = tuple(math.prod(matrix[a] for a in dim_axes) for dim_axes in axes)
        return cls(splits, tuple(owners))

    def trailing(self, n: int) -> "Blocks":
        """The last n dims: a broadcast operand compared with one that has extra leading dims."""
        return Blocks(self.splits[-n:] if n else (), tuple(o[len(o) - n:] for o in self.owners))

    def permute(self, perm: tuple[int, ...]) -> "Blocks":
        return Blocks(tuple(self.splits[p] for p in perm), tuple(tuple(o[p] for p in perm) for o in self.owners))

    def merge(self, groups: tuple[tuple[int, ...], ...]) -> "Blocks":
        """A reshape merging each group of adjacent dims, major first."""
        def one(o):
            out = []
            for g in groups:
                index = 0
                for d in g:
                    index = index * self.splits[d] + o[d]
                out.append(index)
            return tuple(out)
        return Blocks(tuple(math.prod(self.splits[d] for d in g) for g in groups), tuple(one(o) for o in self.owners))

    def __eq__(self, other) -> bool:
        return self.splits == other.splits and self.owners == other.owners

    def __repr__(self) -> str:
        return f"splits{self.splits}"


# ---- ours <-> MindFormers, primitive by primitive --------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pair:
    """Our op's input(s) against a MindFormers primitive's. `ours` picks (op, input index) per
    MindFormers input; a view per input makes the two shapes comparable: "trailing" (a broadcast
    operand: MindFormers' extra leading dims dropped), "bsh" (our BNSD as MindFormers' BSH),
    "tokens" (our (B, T, f) as MindFormers' 2-D (B*T, f)); None compares as is."""
    name: str                                   # our op path: what a failure names
    mf: str                                     # MindFormers primitive path
    ours: tuple[tuple[str, int], ...]
    views: tuple = ()
    out: bool = False                           # compare out_strategy too (in the view of input 0)
    align: tuple = ()                           # per MindFormers input: Blocks.of's align, or None
    mf_inputs: tuple = ()                       # which MindFormers inputs `ours` stands against; () = 0, 1, ...


def _same(name: str, mf: str, n: int, out: bool = False, views: tuple = (), align: tuple = ()) -> Pair:
    return Pair(name, mf, tuple((name, i) for i in range(n)), views, out, align)


def _norm_pairs(ours: str, mf: str, fused: bool) -> list[Pair]:
    if fused:       # RmsNorm(x, gamma): x is what every primitive of our norm reads, gamma mul2's
        return [Pair(ours + ".mul2", mf + ".norm", ((ours + ".square", 0), (ours + ".mul2", 1))),
                *[Pair(f"{ours}.{p}", mf + ".norm", ((f"{ours}.{p}", 0),)) for p in ("mean", "rsqrt", "add")]]
    return [_same(f"{ours}.{p}", f"{mf}.{p}", n) for p, n in
            (("square", 1), ("mean", 1), ("add", 2), ("rsqrt", 1), ("mul", 2), ("mul2", 2))]


def _bsh(b: Blocks) -> Blocks:
    """Our BNSD (B, heads, T, hd) as MindFormers' BSH (B, T, heads*hd)."""
    return b.permute((0, 2, 1, 3)).merge(((0,), (1,), (2, 3)))


def pairs(parallel: dict, model: dict, layers: int) -> list[Pair]:
    """Every primitive of ours with a MindFormers counterpart, for this config."""
    _, _, cp, _ = _degrees(parallel)
    fused = model.get("fused_rms_norm", True)
    flash = model.get("use_flash_attention", False)
    out = [_same("model.embed_tokens.gather", "model.tok_embeddings.gather", 2)]
    for i in range(layers):
        o, m = f"model.layers.{i}.", f"model.layers.{i}."
        a, r = o + "self_attn.", m + "attention."
        out += _norm_pairs(o + "input_layernorm", m + "attention_norm", fused)
        out += _norm_pairs(o + "post_attention_layernorm", m + "ffn_norm", fused)
        out += [_same(a + f"{p}_proj.matmul", r + f"w{p}.matmul", 2) for p in "qkv"]
        out += [_same(a + "o_proj.matmul", r + "wo.matmul", 2, out=True),
                _same(a + "transpose", r + "transpose", 1),
                _same(o + "add", m + "add", 2)]
        rot, mrot = a + "rotary.", r + "apply_rotary_emb."
        out += [_same(rot + "add", mrot + "add", 2), _same(rot + "neg", mrot + "neg", 1),
                _same(rot + "concat", mrot + "concat", 2),
                # cos/sin: ours (T, hd), MindFormers' (1, 1, T, hd): compare the trailing dims
                _same(rot + "mul_cos", mrot + "mul", 2, views=(None, "trailing")),
                _same(rot + "mul_sin", mrot + "mul", 2, views=(None, "trailing"))]
        if model.get("use_rope_slice"):     # the slice MindFormers cuts x in halves with; ours is Split
            out.append(_same(rot + "split", mrot + "slice", 1))
        if flash and cp > 1 and model.get("use_ring_attention"):    # no mask input
            out.append(_same(a + "flash_attention", r + "flash_attention.flash_attention", 3, views=("bsh",) * 3,
                             align=(None, (0, 1, 2), (0, 1, 2))))
        elif flash:
            # MindFormers runs BSH (B, T, heads*hd) when cp > 1, BNSD otherwise; its k, v and mask
            # tuples follow q's device matrix: k/v dim by dim, the mask's B and query-row dims.
            if cp > 1:
                views, align = ("bsh", "bsh", "bsh", None), (None, (0, 1, 2), (0, 1, 2), (0, None, 1, None))
            else:
                views, align = (), (None, (0, 1, 2, 3), (0, 1, 2, 3), (0, None, 2, None))
            out.append(_same(a + "flash_attention", r + "flash_attention.flash_attention", 4, views=views,
                             align=align))
        else:
            if model.get("n_kv_heads", model["num_heads"]) != model["num_heads"]:
                out.append(_same(a + "tile_kv", r + "tile_kv", 1))
            out += [_same(a + "batch_matmul_q_k", r + "batch_matmul_q_k", 2),
                    _same(a + "mul", r + "mul", 2), _same(a + "softmax", r + "softmax", 1),
                    # the additive mask: ours (T, T), MindFormers' (B, 1, T, T)
                    _same(a + "add", r + "add", 2, views=("trailing", None)),
                    _same(a + "batch_matmul", r + "batch_matmul", 2)]
        # (B, heads, T, hd) -> (B, T, heads, hd): MindFormers' flash path with cp > 1 uses it on q and k
        # before the kernel, every other path on the attention output; all hold q's layout
        out.append(_same(a + "merge_heads", r + "merger_head_transpose", 1))
        f, mf = o + "mlp.", m + "feed_forward."
        if "moe_config" in model:
            out += ms_oracle_moe.pairs(Pair, _same, f, mf)
            continue
        out += [_same(f + "gate_proj.matmul", mf + "w1.matmul", 2), _same(f + "up_proj.matmul", mf + "w3.matmul", 2),
                _same(f + "down_proj.matmul", mf + "w2.matmul", 2, out=True), _same(f + "mul", mf + "mul", 2),
                # silu: ours sigmoid + mul on (B, T, ffn), MindFormers' SiLU on the matmul's (tokens, ffn)
                Pair(f + "sigmoid", mf + "w1.activation.silu", ((f + "sigmoid", 0),), ("tokens",)),
                Pair(f + "silu_mul", mf + "w1.activation.silu", ((f + "silu_mul", 0),), ("tokens",))]
    out += _norm_pairs("model.norm", "model.norm_out", fused)
    out.append(_same("lm_head.matmul", "lm_head.matmul", 2))
    ls, nll = "loss._log_softmax.", "loss._nllloss."
    out += [_same("loss.max", ls + "max", 1), _same("loss.sub", ls + "sub", 2), _same("loss.exp", ls + "exp", 1),
            _same("loss.sum", ls + "sum", 1), _same("loss.log", ls + "log", 1),
            _same("loss.sub2", ls + "sub", 2),    # MindFormers calls one Sub twice
            _same("loss.onehot", ls + "onehot", 3), _same("loss.mul", nll + "mul", 2),
            _same("loss.neg", nll + "neg", 1), _same("loss.sum2", nll + "sum", 1)]
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where MindFormers chooses differently and ms_llm keeps its own layout: for configs where
    `when(dp, mp, cp, parallel_config)` holds, our ops matching `ops` (globs) differ, because `why`."""
    when: Callable[[int, int, int, dict], bool]
    ops: tuple[str, ...]
    why: str


CHOICES = (
    Choice(lambda dp, mp, cp, pc: pc.get("vocab_emb_dp", True) and mp > 1,
           ("model.embed_tokens.gather", "lm_head.matmul"),
           "vocab_emb_dp: MindFormers replicates the embedding table and lm_head over model_parallel; ms_llm's "
           "plan always splits the vocabulary over tp (mp times less memory; the converter warns). The loss is "
           "vocab-parallel (dp*cp, mp) in both, and compared."),
    Choice(lambda dp, mp, cp, pc: cp > 1, ("model.embed_tokens.gather",),
           "context parallel: MindFormers splits the table over mp*cp and gathers every token over cp, reducing "
           "the lookup over mp*cp; ms_llm's plan splits the table over tp only and each rank looks up its own "
           "sequence chunk, so the partial sums reduce over tp alone (less communication, more table memory)."),
    Choice(lambda dp, mp, cp, pc: cp > 1 and not pc.get("use_seq_parallel", False),
           ("model.layers.*.input_layernorm.*", "model.layers.*.post_attention_layernorm.*"),
           "context parallel: MindFormers computes the layer norms on (dp, cp*mp, 1) without use_seq_parallel, so "
           "the residual stream (dp, cp, 1) is sliced over mp and the norm output all-gathered over mp again before "
           "q/k/v and w1/w3; ours norms in the residual stream's own layout: no communication, which two all-gathers "
           "per layer cost more than the mp-fold norm work they save."),
    Choice(lambda dp, mp, cp, pc: cp > 1, ("model.layers.*.self_attn.rotary.neg", "model.layers.*.self_attn.rotary.concat"),
           "context parallel: MindFormers' rope-slice primitives (neg, slice, concat) keep (dp, mp, 1, 1) while its "
           "own rotary add/mul split the sequence over cp, so q and k would be gathered over cp and split again; "
           "MindFormers is inconsistent here. Ours splits the sequence over cp in every rotary primitive."),
    Choice(lambda dp, mp, cp, pc: cp > 1 and pc.get("context_parallel_algo") == "ulysses_cp",
           ("model.layers.*.self_attn.o_proj.matmul",),
           "ulysses_cp: MindFormers' wo writes its output reduce-scattered over dp*cp*mp (out (dp*cp*mp, 1)) "
           "even without use_seq_parallel, and its residual add, (dp, cp, 1) as ours, gathers it over mp again; "
           "ours writes the residual stream's layout directly: one all-reduce for a reduce-scatter + all-gather."),
    Choice(lambda dp, mp, cp, pc: pc.get("use_seq_parallel", False), ("model.norm.*",),
           "sequence parallel: MindFormers gathers the sequence before the final norm (dp, cp, 1); ours keeps the "
           "residual stream's sequence-parallel layout through the final norm and gathers before lm_head "
           "(Megatron's choice: the same all-gather, 1/mp of the norm's work)."),
)


def _choice(case: str, op: str) -> Choice | None:
    parallel = CASES[case][0]
    dp, mp, cp, _ = _degrees(parallel)
    for c in CHOICES:
        if c.when(dp, mp, cp, parallel) and any(fnmatch.fnmatchcase(op, g) for g in c.ops):
            return c
    return None


VIEWS = {**ms_oracle_moe.VIEWS, **ms_oracle_deepseek.VIEWS}


def _view(kind, blocks: Blocks, mf_dims: int) -> Blocks:
    if kind is None:
        return blocks
    if kind == "bsh":
        return _bsh(blocks) if len(blocks.splits) == 4 and mf_dims == 3 else blocks
    if kind == "tokens":
        return blocks.merge(((0, 1), (2,)))
    raise AssertionError(kind)


def _blocks(view, mine, their, devices: int, first=None, align=None) -> tuple[Blocks, Blocks]:
    """Both strategies as Blocks, lined up by `view`."""
    if align is not None and isinstance(mine, LayoutStrategy) and isinstance(first, list):
        theirs_blocks = Blocks.of(their, devices, first, align)
    else:
        theirs_blocks = Blocks.of(their, devices)
    mine_blocks = Blocks.of(mine, devices)
    if view == "trailing":
        return mine_blocks, theirs_blocks.trailing(len(mine_blocks.splits))
    if view in VIEWS:
        return VIEWS[view](mine_blocks, theirs_blocks)
    return _view(view, mine_blocks, len(theirs_blocks.splits)), theirs_blocks


def compare(pair: Pair, ours: dict[str, OpShard], theirs: dict, devices: int) -> str | None:
    """None when equal, else what differs."""
    mf = theirs.get(pair.mf)
    if mf is None:
        return f"MindFormers has no sharded primitive {pair.mf}"
    problems = []
    views = pair.views or (None,) * len(pair.ours)
    for k, ((op, index), view) in enumerate(zip(pair.ours, views)):
        if op not in ours:
            return f"ours has no op {op}"
        mf_k = pair.mf_inputs[k] if pair.mf_inputs else k
        mine, their = ours[op].inputs[index], mf["in"][mf_k]
        if their == [] or mine == ():
            if (their == []) != (mine == ()):
                problems.append(f"input {mf_k}: ours {mine}, MindFormers {their}")
            continue
        if isinstance(their, dict):      # a MindFormers Layout says where each rank is: so does our layout
            mine = as_layout(ours[op].layouts[index])
        align = pair.align[k] if pair.align else None
        mine_blocks, theirs_blocks = _blocks(view, mine, their, devices, mf["in"][0], align)
        if mine_blocks != theirs_blocks:
            problems.append(f"input {mf_k}: ours {mine} ({mine_blocks}), MindFormers {their} ({theirs_blocks})")
    if pair.out:
        mine_out = ours[pair.name].output
        # no out_strategy: MindSpore's MatMul default, the all-reduced (rows of a, rows of b^T)
        their_out = mf["out"] or [[mf["in"][0][0], mf["in"][1][0]]]
        if mine_out is None:
            problems.append(f"out: ours none, MindFormers {their_out}")
            return "; ".join(problems)
        if isinstance(their_out[0], dict):
            mine_out = (as_layout(ours[pair.name].layouts[-1]),)
        if operator.ne(*_blocks(views[0], mine_out[0], their_out[0], devices)):
            problems.append(f"out: ours {mine_out}, MindFormers {their_out}")
    return "; ".join(problems) or None


# ---- the oracle run and our side --------------------------------------------------------------

@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory) -> dict:
    """MindFormers' strategies and parameters for every case, from one subprocess (in a folder of its own:
    MindFormers' logger writes output/log/ into the working directory)."""
    if not (ORACLES / "mindformers").is_dir():
        pytest.fail(".oracles/ is missing: run `make oracles` (installs MindFormers beside .venv)")
    cases = [{"name": name, "devices": _devices(par), "parallel": par, "model": {**MODEL, **mod}}
             for name, (par, mod) in CASES.items()]
    env = {**os.environ, "PYTHONPATH": str(ORACLES), "GLOG_v": "3"}
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path_factory.mktemp("oracle"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mindformers"].startswith("2.1."), f"the oracle is MindFormers 2.1, .oracles has {result['mindformers']}"
    return result


@pytest.fixture(scope="module")
def oracle(oracle_run) -> dict:
    """Per case, MindFormers' sharded primitives by path."""
    return oracle_run["cases"]


def ours_for(parallel: dict, model: dict) -> dict[str, OpShard]:
    """Our lowering of the same MindFormers config, through our MindFormers converter."""
    source = {"parallel_config": parallel, "model": {"model_config": {**MODEL, **model}},
              "runner_config": {"batch_size": 1}}
    conv = read(yaml.safe_dump(source), "oracle.yaml", ReadOptions())
    return {o.op: o for o in lower(plan(conv.job.model, conv.job.strategy, conv.job.train, conv.world_size)).ops}


def test_our_layouts_mean_in_mindspore_what_we_compared():
    """Every Layout strategy of ours, built by MindSpore (Layout(...)(...).to_dict()), places the
    same blocks on the same ranks as the LayoutStrategy the oracle comparison read."""
    pytest.importorskip("mindspore")
    seen = 0
    for case, (parallel, model) in CASES.items():
        devices = _devices(parallel) // _degrees(parallel)[3]
        for op in ours_for(parallel, model).values():
            for s in op.inputs + (op.output or ()):
                if isinstance(s, LayoutStrategy):
                    assert Blocks.of(s.build().to_dict(), devices) == Blocks.of(s, devices), (case, op.op, str(s))
                    seen += 1
    assert seen


@pytest.mark.parametrize("case", CASES)
def test_lowering_matches_mindformers(case, oracle):
    parallel, model = CASES[case]
    ours = ours_for(parallel, model)
    devices = _devices(parallel) // _degrees(parallel)[3]     # ranks of one pipeline stage
    diffs, agreed = [], []
    for pair in pairs(parallel, {**MODEL, **model}, MODEL["num_layers"]):
        problem = compare(pair, ours, oracle[case], devices)
        choice = _choice(case, pair.name)
        if choice is None and problem is not None:
            diffs.append(f"{pair.name} vs {pair.mf}: {problem}")
        elif choice is not None and problem is None:
            agreed.append(f"{pair.name}: listed in CHOICES ({choice.why[:60]}...) but equal to MindFormers")
    assert not diffs and not agreed, "\n".join(diffs + agreed)


@pytest.mark.parametrize("case", [c for c, (_, m) in CASES.items() if m.get("use_flash_attention")])
def test_flash_attention_attributes_match_mindformers(case, oracle):
    """FlashAttentionScore as MindFormers builds it: the kernel settings of our model's primitive
    (head count, scale, causal window, sparse mode), and the ring-attention switches our lowering
    adds (enable_ring_attention, enable_ra_send_recv) exactly where use_ring_attention adds them."""
    pytest.importorskip("mindspore")
    from ms_llm.mindspore.lower import RING_ATTRS
    from ms_llm.mindspore.model import Attention

    parallel, model = CASES[case]
    theirs = dict(oracle[case]["model.layers.0.attention.flash_attention.flash_attention"]["attrs"])
    ring = {k: theirs.pop(k) for k, _ in RING_ATTRS if k in theirs}
    source = {"parallel_config": parallel, "model": {"model_config": {**MODEL, **model}},
              "runner_config": {"batch_size": 1}}
    built = Attention(read(yaml.safe_dump(source), "oracle.yaml", ReadOptions()).job.model).flash_attention.attrs
    assert {k: built[k] for k in theirs} == pytest.approx(theirs, rel=1e-6)   # scale: our fp32 1/sqrt(hd)
    assert dict(ours_for(parallel, model)["model.layers.0.self_attn.flash_attention"].attrs) == ring
    assert bool(ring) == bool(model.get("use_ring_attention"))


def test_the_comparison_can_fail(oracle):
    """A wrong strategy is caught: q_proj's weight split over the wrong dim, or ranks reordered."""
    parallel, model = CASES["dp2_mp4"]
    ours = ours_for(parallel, model)
    pair = _same("model.layers.0.self_attn.q_proj.matmul", "model.layers.0.attention.wq.matmul", 2)
    assert compare(pair, ours, oracle["dp2_mp4"], 8) is None
    good = ours[pair.name]
    ours[pair.name] = OpShard(good.op, (good.inputs[0], (1, 4)))
    assert "input 1" in compare(pair, ours, oracle["dp2_mp4"], 8)
    swapped = LayoutStrategy((4, 2), ("tp", "dp"), (("dp",), ()))     # dp split, but dp outermost no more
    ours[pair.name] = OpShard(good.op, (swapped, good.inputs[1]))
    assert "input 0" in compare(pair, ours, oracle["dp2_mp4"], 8)


def test_every_mindformers_layer_primitive_is_accounted_for(oracle):
    """Each sharded primitive of a MindFormers decoder layer is compared, or is on a path ours
    does not have (listed here with why; the MoE layer's in ms_oracle_moe.NOT_OURS, every entry of
    which some primitive needs), so a new MindFormers primitive cannot slip by."""
    not_ours = {
        "attention.apply_rotary_emb.bmm_swap": "rotate_half as a matmul with a swap matrix; ours is split/neg/concat",
        "attention.apply_rotary_emb.mul_inc": "incremental decoding (use_past)",
        "attention.apply_rotary_emb.mul_with_batch_freqs": "per-sample rotary tables (EOD reset)",
        "attention.apply_rotary_emb.slice": "rope slice, compared where use_rope_slice is on",
        "feed_forward.w13_concat": "w1/w3 concatenated weights (qkv_concat)",
        "attention.flash_attention.flash_attention": "compared where use_flash_attention is on",
        **{f"attention.{t}": "ulysses_cp writes its all-to-alls as reshape + transposes; ours leaves them to "
                              "MindSpore's redistribution between the rotary output (sequence over cp) and the "
                              "attention core (heads over cp*mp), whose strategies are compared"
           for t in ("transpose_back", "transpose_ulysses", "transpose_a2a", "transpose_ulysses_merger_a2a",
                     "transpose_ulysses_merger")},
    }
    moe_used = set()
    for case, (parallel, model) in CASES.items():
        mdl = {**MODEL, **model}
        compared = {p.mf.removeprefix("model.layers.0.") for p in pairs(parallel, mdl, 1)}
        flash = mdl.get("use_flash_attention", False)
        for name in oracle[case]:
            if not name.startswith("model.layers.0."):
                continue
            short = name.removeprefix("model.layers.0.")
            if short in compared or short in not_ours:
                continue
            if "moe_config" in model and ms_oracle_moe.explained(short):
                moe_used.add(ms_oracle_moe.explained(short))
                continue
            # the BatchMatMul path is dead code in MindFormers once flash attention is on
            if flash and short.startswith("attention.") and short.split(".")[1] in (
                    "batch_matmul", "batch_matmul_q_k", "mul", "add", "softmax", "tile_kv"):
                continue
            if short == "attention.tile_kv":      # GQA only
                continue
            raise AssertionError(f"{case}: MindFormers primitive {name} is neither compared nor explained")
    assert moe_used == set(ms_oracle_moe.NOT_OURS), f"NOT_OURS entries no primitive needs: " \
                                                    f"{set(ms_oracle_moe.NOT_OURS) - moe_used}"


def test_the_moe_all_to_all_placement_can_fail(oracle):
    """The all-to-all over ep sits where MindFormers' does, and moving it is caught: transpose_in given the
    dispatch's token-group layout (the all-to-all pushed past it, into the experts) and transpose_out
    given the experts' layout (pulled past it, into the combine) both differ from transpose_5dim_ep2."""
    case = "dp4_mp2_ep2_moe"
    parallel, model = CASES[case]
    ours = ours_for(parallel, model)
    p, m = "model.layers.0.mlp.", "model.layers.0.feed_forward."
    moe_pairs = {q.name: q for q in ms_oracle_moe.pairs(Pair, _same, p, m)}
    moved = {"transpose_in": (4, 1, 1, 1),         # (G, E, C, H) groups over edp x ep, E whole
             "transpose_out": (2, 2, 1, 1)}        # (E, G, C, H) E over ep, groups over edp
    for op, strategy in moved.items():
        pair = moe_pairs[p + op]
        assert compare(pair, ours, oracle[case], 8) is None
        good = ours[p + op]
        ours[p + op] = OpShard(good.op, (strategy,))
        assert "input 0" in compare(pair, ours, oracle[case], 8), op
        ours[p + op] = good


def test_expert_tensor_parallel_carved_from_dp_by_hand():
    """ep2 x etp2 over dp4 (etp carved out of data parallel) has no MindFormers counterpart: its MoE splits an
    expert over 1 or model_parallel ranks. So the experts' strategies, as MindSpore is given them, are checked
    by hand: rank r = (ep, etp) = divmod(r, 2) holds experts 2ep, 2ep+1, the etp half of their width (gate
    and down weights, the SwiGLU hidden) and every row of their two token groups (edp 1)."""
    model = from_dict(ModelConfig, {"vocab_size": 512, "hidden_size": 256, "num_layers": 2, "num_heads": 8,
                                    "ffn_hidden_size": 512, "max_seq_len": 64,
                                    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 128}}, "model")
    p = plan(model, ParallelStrategy(dp=4, ep=2, etp=2), TrainConfig(global_batch_size=4, micro_batch_size=1,
                                                                      seq_len=64), 4)
    ops = {o.op: o for o in lower(p).ops}
    x = "model.layers.0.mlp.experts."
    expect = {(x + "bmm_gate", 0): lambda ep, etp: (ep, 0, 0),      # rows (E, G*C, H): whole over etp
              (x + "bmm_gate", 1): lambda ep, etp: (ep, etp, 0),    # gate_proj (E, F, H)
              (x + "bmm_down", 0): lambda ep, etp: (ep, 0, etp),    # SwiGLU hidden (E, G*C, F)
              (x + "bmm_down", 1): lambda ep, etp: (ep, 0, etp)}    # down_proj (E, H, F)
    for (op, i), block in expect.items():
        given = ops[op].inputs[i]
        assert Blocks.of(given, 4).owners == tuple(block(*divmod(r, 2)) for r in range(4)), (op, i, str(given))
        if isinstance(given, LayoutStrategy):                       # as MindSpore builds it, too
            assert Blocks.of(given.build().to_dict(), 4) == Blocks.of(given, 4)
    assert Blocks.of(ops["model.layers.0.mlp.gate.matmul"].inputs[0], 4).splits == (4, 1)    # routed per dp rank


def _mf_weight_blocks(records: dict, mf: str, devices: int) -> Blocks:
    """Which block of MindFormers' weight `mf` each rank holds, in the device matrix of the primitive that
    uses it: a Linear's weight (N, K) follows its input's (.., K) with N on the replicas axis (MatMul's
    (dp, k, n)), an expert weight as its BatchMatMul pair aligns it, the embedding table the Gather's
    (index batch, vocab) matrix, a norm's gamma is whole."""
    op, w, first = ms_oracle_moe.mf_weight(records, mf)
    if op == "gather":       # GatherInfo, batch and vocabulary split: dev matrix (index[0], param[0]), replicas last
        assert w[1] == 1, f"{mf}: {w}: the table split on its hidden dim is not Gather's batch-and-axis case"
        return Blocks._expand((first[0], w[0], devices // (first[0] * w[0])), [[1], []], devices)
    if op == "norm":
        return Blocks.of(w, devices)
    n = len(first)
    if len(w) == 2:
        align = (n, n - 1)
    else:
        align = (1, None, 3) if op == "down" else (1, 4, 3)
    return Blocks.of(w, devices, first=first, align=align)


# The MoE cases, and dense ones with tp 4 (MindSpore's groups of 2 end inside tp) and tp 2 (sequence parallel).
OPTIMIZER_CASES = list(ms_oracle_moe.CASES) + ["dp2_mp4", "dp2_mp2_sp_gqa_flash"]


@pytest.mark.parametrize("case", OPTIMIZER_CASES)
def test_parallel_optimizer_splits_as_mindspore_on_mindformers_models(case, oracle_run):
    """ZeRO on Ascend is MindSpore's parallel optimizer (enable_parallel_optimizer, as MindFormers' configs
    turn it on): each weight's optimizer state is split over the ranks holding the same slice of it, in rank
    order, in groups of optimizer_weight_shard_size. For every weight of MindFormers' model, each rank's box
    of it in the split our lowering records (lower.parallel_optimizer_plan: what the compiled step's
    checkpoints and strategy files name) is the box MindSpore's rule, taken rank by rank
    (ms_oracle_moe.optimizer_places), gives on MindFormers' layout of that weight with our lowering's shard
    size. That is the plan's ZeRO split for the tensor-parallel weights (over dp) and the routed experts
    (over edp), and not for those every tp rank holds whole (norms, router): MindSpore splits them tp first,
    where the plan says dp; the plan's split fails the check there. MindFormers' own settings (shard size
    -1, a 64 KB threshold, its norms and embedding kept out) split what they split over as many ranks;
    KEPT_WHOLE says what it keeps whole. The dense group as the shard size, what the lowering passed before,
    leaves dp4 x mp2 x ep2's experts (edp 2 under a dense group of 4) unsplit: the check fails on it."""
    parallel, model = CASES[case]
    source = {"parallel_config": parallel, "model": {"model_config": {**MODEL, **model}},
              "runner_config": {"batch_size": 1}, "parallel": {"enable_parallel_optimizer": True}}
    conv = read(yaml.safe_dump(source), "oracle.yaml", ReadOptions())
    p = plan(conv.job.model, conv.job.strategy, conv.job.train, conv.world_size)
    shard_size = lower(p).context["parallel_optimizer_config"]["optimizer_weight_shard_size"]
    recorded = parallel_optimizer_plan(p)
    devices = _devices(parallel) // _degrees(parallel)[3]
    records, theirs_params = oracle_run["cases"][case], oracle_run["params"][case]
    tp_whole, experts = 0, 0
    for name, q in p.params.items():
        mf = ms_oracle_moe.mf_param(name)
        info = theirs_params[mf]
        assert tuple(info["shape"]) == q.shape, (name, mf)
        blocks = _mf_weight_blocks(records, mf, devices)
        boxes = lambda layout: [layout.shard_box(r) for r in range(devices)]     # noqa: E731
        assert boxes(q.layout) == [ms_oracle_moe.place_box(o, blocks.splits, q.shape, (0, 1)) for o in blocks.owners]
        rule = ms_oracle_moe.optimizer_places(blocks.owners, q.shape, blocks.splits[0], shard_size)
        ours = boxes(recorded.params[name].optimizer_layout)
        assert ours == [ms_oracle_moe.place_box(o, blocks.splits, q.shape, place)
                        for o, place in zip(blocks.owners, rule)], name
        whole_over_tp = p.strategy.tp > 1 and q.kind not in EXPERT_KINDS and not any(
            "tp" in q.layout.axes_of(d) for d in range(len(q.shape)))
        assert (boxes(q.optimizer_layout) != ours) == whole_over_tp, name        # the plan's split is MindSpore's
        tp_whole += whole_over_tp
        theirs = ms_oracle_moe.optimizer_places(blocks.owners, q.shape, blocks.splits[0], ms_oracle_moe.MF_SHARD_SIZE,
                                                info["parallel_optimizer"], ms_oracle_moe.MF_THRESHOLD_KB)
        if ms_oracle_moe.kept_whole(mf):
            assert {n for _, n in theirs} == {1}, mf
        else:
            assert {n for _, n in theirs} == {n for _, n in rule}, mf
        if q.kind in EXPERT_KINDS:
            experts += 1
            assert {n for _, n in rule} == {p.expert_zero.group_size} == {p.strategy.edp}
            if p.strategy.edp not in (1, p.zero.group_size):
                dense = ms_oracle_moe.optimizer_places(blocks.owners, q.shape, blocks.splits[0], p.zero.group_size)
                assert {n for _, n in dense} == {1}, name
    assert experts == (3 * MODEL["num_layers"] if "moe_config" in model else 0)
    assert tp_whole >= 2 * MODEL["num_layers"] + 1                    # the norms at least
    assert {ms_oracle_moe.mf_param(n) for n in p.params} == set(theirs_params)


# ---- DeepSeek-V3: MindFormers 2.1's own training graph (ms_oracle_deepseek.py) ----------------------

DEEPSEEK_CHOICES = (
    Choice(lambda dp, mp, cp, pc: mp > 1, ("model.layers.*.self_attn.tile_k", "model.mtp.*.layer.self_attn.tile_k"),
           "the rotary key every head shares: MindFormers tiles it into all heads on every tp rank (tile_kv "
           "(cp, dp, 1, 1)) and pe_concat then keeps the rank's heads; ours tiles it straight into the rank's own "
           "heads (tp-fold less tiling, no slice), the concat with k_nope being the same (cp, dp, tp, 1) in both."),
    Choice(lambda dp, mp, cp, pc: mp > 1, ("model.layers.*.mlp.shared_experts.*", "model.mtp.*.layer.mlp.shared_experts.*"),
           "shared experts: MindFormers 2.1 replicates their weights over tp and runs them on each rank's "
           "sequence-parallel tokens, like its routed experts (tp folded into data parallel); the plan splits them "
           "over tp as a dense MLP (Megatron-core's SharedExpertMLP: column- then row-parallel), tp-fold less "
           "weight and optimizer memory for one all-gather and one reduce-scatter of the tokens."),
    Choice(lambda dp, mp, cp, pc: mp > 1, ("model.mtp.*.eh_proj.matmul",),
           "the MTP projection eh_proj: MindFormers replicates its (H, 2H) weight and runs it on each rank's "
           "sequence-parallel tokens; the plan makes it column-parallel over tp with its output gathered (the "
           "plan's mtp_proj, Megatron-core's MultiTokenPredictionLayer), tp-fold less weight memory."),
)


def _deepseek_choice(case: str, op: str) -> Choice | None:
    parallel = ms_oracle_deepseek.CASES[case][0]
    dp, mp, cp, _ = ms_oracle_deepseek.degrees(parallel)
    for c in DEEPSEEK_CHOICES:
        if c.when(dp, mp, cp, parallel) and any(fnmatch.fnmatchcase(op, g) for g in c.ops):
            return c
    return None


def _ds_pair(name: str, mf: str, ours: tuple, views: tuple = (), out: bool = False, index: tuple = ()) -> Pair:
    return Pair(name, mf, ours, views, out, (), index)


@pytest.fixture(scope="module")
def deepseek_oracle(tmp_path_factory) -> dict:
    """MindFormers' DeepSeek-V3 strategies and stages for every DeepSeek case, from one subprocess."""
    if not (ORACLES / "mindformers").is_dir():
        pytest.fail(".oracles/ is missing: run `make oracles` (installs MindFormers beside .venv)")
    cases = []
    for name, (parallel, _) in ms_oracle_deepseek.CASES.items():
        dp, tp, cp, pp = ms_oracle_deepseek.degrees(parallel)
        cases.append({"name": name, "devices": dp * tp * cp * pp, "stages": pp, "yaml": ms_oracle_deepseek.yaml_text(name)})
    env = {**os.environ, "PYTHONPATH": str(ORACLES), "GLOG_v": "3"}
    proc = subprocess.run([sys.executable, str(DEEPSEEK_PROBE), json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path_factory.mktemp("deepseek_oracle"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mindformers"].startswith("2.1."), f"the oracle is MindFormers 2.1, .oracles has {result['mindformers']}"
    return result["cases"]


def deepseek_lowering(case: str):
    """Our lowering of the same MindFormers 2.x YAML, through our MindFormers converter."""
    conv = read(ms_oracle_deepseek.yaml_text(case), f"{case}.yaml", ReadOptions())
    assert conv.job.model.mla is not None and conv.job.model.mtp_layers == 1 and conv.job.model.moe.expert_bias
    return lower(plan(conv.job.model, conv.job.strategy, conv.job.train, conv.world_size))


@pytest.mark.parametrize("case", ms_oracle_deepseek.CASES)
def test_deepseek_lowering_matches_mindformers(case, deepseek_oracle):
    parallel = ms_oracle_deepseek.CASES[case][0]
    dp, tp, cp, _ = ms_oracle_deepseek.degrees(parallel)
    ours = {o.op: o for o in deepseek_lowering(case).ops}
    diffs, agreed, compared = [], [], 0
    for pair in ms_oracle_deepseek.pairs(_ds_pair, parallel):
        problem = compare(pair, ours, deepseek_oracle[case]["ops"], dp * tp * cp)
        choice = _deepseek_choice(case, pair.name)
        compared += 1
        if choice is None and problem is not None:
            diffs.append(f"{pair.name} vs {pair.mf}: {problem}")
        elif choice is not None and problem is None:
            agreed.append(f"{pair.name}: listed in DEEPSEEK_CHOICES ({choice.why[:60]}...) but equal to MindFormers")
    assert not diffs and not agreed, "\n".join(diffs + agreed)
    assert compared > 200


def test_deepseek_mtp_sits_on_the_last_stage_beside_lm_head(deepseek_oracle):
    """Pipeline stages: every cell both sides place, MindFormers' on its stage, ours on the same; MTP
    with lm_head on the last stage."""
    for case, (parallel, _) in ms_oracle_deepseek.CASES.items():
        pp = ms_oracle_deepseek.degrees(parallel)[3]
        low = deepseek_lowering(case)
        assert low.cell_stages["model.mtp.0"] == low.cell_stages["lm_head"] == (pp - 1, 0)
        if pp == 1:
            continue
        theirs = deepseek_oracle[case]["stages"]
        assert {o: low.cell_stages[o][0] for o in ms_oracle_deepseek.STAGE_CELLS} == \
            {o: theirs[m] for o, m in ms_oracle_deepseek.STAGE_CELLS.items()}
        assert theirs["model.mtp"] == pp - 1


def test_the_deepseek_comparison_can_fail(deepseek_oracle):
    """The two differences the comparison found, put back, are caught: MLA's latents whole over tp under
    sequence parallel (the down-projections on gathered tokens), and the router on tokens gathered over tp."""
    case = "ds_dp2_tp2_sp_ep2"
    ours = {o.op: o for o in deepseek_lowering(case).ops}
    pairs = {p.name: p for p in ms_oracle_deepseek.pairs(_ds_pair, ms_oracle_deepseek.CASES[case][0])}
    for name in ("model.layers.1.self_attn.q_a_proj.matmul", "model.layers.1.mlp.gate.matmul"):
        assert compare(pairs[name], ours, deepseek_oracle[case]["ops"], 4) is None
        good = ours[name]
        gathered = [whole_over(good.layouts[0], "tp"), good.layouts[1]]
        ours[name] = dataclasses.replace(good, layouts=tuple(gathered) + (None,))
        assert "input 0" in compare(pairs[name], ours, deepseek_oracle[case]["ops"], 4)


def test_every_mindformers_deepseek_primitive_is_accounted_for(deepseek_oracle):
    """Each sharded primitive of MindFormers' decoder layers (dense and MoE) and MTP module is compared or
    listed in ms_oracle_deepseek.NOT_OURS with why, so a new MindFormers primitive cannot slip by; and
    every NOT_OURS entry names a primitive MindFormers has, so the list cannot go stale."""
    used = set()
    for case, (parallel, _) in ms_oracle_deepseek.CASES.items():
        compared = {p.mf for p in ms_oracle_deepseek.pairs(_ds_pair, parallel)}
        for name in deepseek_oracle[case]["ops"]:
            for prefix in ("model.decoder.layers.0.", "model.decoder.layers.1.", "model.mtp.layers.0.transformer_layer.",
                           "model.mtp.layers.0."):
                if name.startswith(prefix):
                    break
            else:
                continue
            if name in compared:
                continue
            why = ms_oracle_deepseek.explained(name.removeprefix(prefix))
            if why is None:
                raise AssertionError(f"{case}: MindFormers primitive {name} is neither compared nor explained")
            used.add(why)
    assert used == set(ms_oracle_deepseek.NOT_OURS), f"NOT_OURS entries no primitive needs: {set(ms_oracle_deepseek.NOT_OURS) - used}"
