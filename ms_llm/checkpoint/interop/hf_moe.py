"""Tensor names of Hugging Face MoE checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3 with its multi-token
prediction layers) <-> ms_llm's canonical tensors.

ms_llm stacks the routed experts of a layer along dim 0 (`mlp.experts.gate_proj.weight` (E, F, H),
`up_proj` likewise, `down_proj` (E, H, F)) so expert parallelism is a split of that dimension.
On the Hub each expert is its own tensor:
  - Mixtral: `block_sparse_moe.experts.E.w1.weight` (w1 = gate, w3 = up, w2 = down), router
    `block_sparse_moe.gate.weight`;
  - Qwen3-MoE, DeepSeek-V3 (and what transformers 5's save_pretrained writes for them):
    `mlp.experts.E.gate_proj.weight` ..., router `mlp.gate.weight` as ours;
  - transformers 5 in memory (a state dict saved as is): `mlp.experts.gate_up_proj` (E, 2F, H),
    gate rows first, and `mlp.experts.down_proj` (E, H, F): import reads these too.
DeepSeek's multi-token prediction module d sits at `model.layers.{num_layers + d}.`: enorm, hnorm,
eh_proj, shared_head.norm and a decoder layer's tensors, with copies of embed_tokens and
shared_head.head (the main model's, which ms_llm shares); ours are `model.mtp.{d}.` (enorm, hnorm,
eh_proj, norm, layer.<decoder layer>). Everything else keeps its name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.storage.safetensors_io import write_file
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError

# canonical stacked projection -> Mixtral's per-expert weight
EXPERT_WEIGHTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_CANONICAL = re.compile(r"^(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.(gate_proj|up_proj|down_proj)\.weight)$")
_STACKED = re.compile(r"^(.*\.)mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight$")
_OURS_MTP = re.compile(r"^model\.mtp\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PER_EXPERT = re.compile(r"^(.*\.)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_EXPERT = re.compile(r"^(.*\.)block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_FUSED = re.compile(r"^(.*\.)mlp\.experts\.(gate_up_proj|down_proj)$")
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def mixtral_names(name: str, num_experts: int) -> Optional[list[str]]:
    """The Hub names holding canonical tensor `name` (one per expert for a stacked tensor, in
    expert order); None for a tensor named alike in both."""
    match = _CANONICAL.match(name)
    if match is None:
        return None
    prefix, _, proj = match.groups()
    if proj is None:
        return [f"{prefix}block_sparse_moe.gate.weight"]
    return [f"{prefix}block_sparse_moe.experts.{e}.{EXPERT_WEIGHTS[proj]}.weight" for e in range(num_experts)]


def deepseek_mtp_name(name: str, num_layers: int) -> str:
    """DeepSeek's checkpoint name of a canonical MTP tensor (model.mtp.{d}.* -> model.layers.{L + d}.*)."""
    d, rest = _OURS_MTP.match(name).groups()
    rest = "shared_head.norm.weight" if rest == "norm.weight" else rest.removeprefix("layer.")
    return f"model.layers.{num_layers + int(d)}.{rest}"


def export_names(name: str, model: ModelConfig, mixtral: bool, mtp: bool) -> list[tuple[str, Optional[int]]]:
    """[(Hub name, expert index or None)] holding canonical tensor `name` on export ([] when it is
    left out: the MTP modules with `mtp` False). With the MTP modules kept, the embedding and the
    head also fill each MTP layer's copies (DeepSeek's layout)."""
    if mixtral:
        hub = mixtral_names(name, model.moe.num_experts)
        if hub is None or len(hub) == 1:
            return [((hub or [name])[0], None)]
        return [(h, e) for e, h in enumerate(hub)]
    if _OURS_MTP.match(name):
        if not mtp:
            return []
        name = deepseek_mtp_name(name, model.num_layers)
    copies = []
    if mtp and name == "model.embed_tokens.weight":
        copies = ["embed_tokens.weight"] + (["shared_head.head.weight"] if model.tie_embeddings else [])
    elif mtp and name == "lm_head.weight":
        copies = ["shared_head.head.weight"]
    stacked = _STACKED.match(name)
    if stacked is not None:
        prefix, proj = stacked.groups()
        return [(f"{prefix}mlp.experts.{e}.{proj}.weight", e) for e in range(model.moe.num_experts)]
    return [(name, None)] + [(f"model.layers.{model.num_layers + d}.{c}", None)
                             for d in range(model.mtp_layers) for c in copies]


@dataclass(frozen=True)
class Source:
    """Where a canonical tensor comes from: one Hub tensor (`half` 0 / 1: the gate / up rows of a
    fused gate_up_proj), or one per expert (`experts`: Hub names in expert order)."""
    hub: str = ""
    half: Optional[int] = None
    experts: tuple[str, ...] = ()


def _canonical_of(hub: str, num_layers: int) -> list[tuple[str, Optional[int], Optional[int]]]:
    """[(canonical name, expert index, half)] that Hub tensor `hub` holds a part of; [] for the MTP
    layers' copies of the embedding and head."""
    layer = _LAYER.match(hub)
    if layer is not None and int(layer.group(1)) >= num_layers:
        d, rest = int(layer.group(1)) - num_layers, layer.group(2)
        if rest in MTP_SHARED:
            return []
        hub = f"model.mtp.{d}." + ("norm.weight" if rest == "shared_head.norm.weight" else
                                  rest if rest in MTP_OWN else f"layer.{rest}")
    if m := _PER_EXPERT.match(hub):
        return [(f"{m.group(1)}mlp.experts.{m.group(3)}.weight", int(m.group(2)), None)]
    if m := _MIXTRAL_EXPERT.match(hub):
        proj = {v: k for k, v in EXPERT_WEIGHTS.items()}[m.group(3)]
        return [(f"{m.group(1)}mlp.experts.{proj}.weight", int(m.group(2)), None)]
    if m := _FUSED.match(hub):
        if m.group(2) == "down_proj":
            return [(f"{m.group(1)}mlp.experts.down_proj.weight", None, None)]
        return [(f"{m.group(1)}mlp.experts.gate_proj.weight", None, 0),
                (f"{m.group(1)}mlp.experts.up_proj.weight", None, 1)]
    return [(hub.replace(".block_sparse_moe.gate.", ".mlp.gate."), None, None)]


def import_sources(names: list[str], num_layers: int, num_experts: int, folder: object) -> dict[str, Source]:
    """Canonical name -> Source for the Hub tensors `names`; every stacked tensor must have each of
    its `num_experts` experts once."""
    experts: dict[str, dict[int, str]] = {}
    sources: dict[str, Source] = {}
    for hub in names:
        for name, expert, half in _canonical_of(hub, num_layers):
            if expert is not None:
                experts.setdefault(name, {})[expert] = hub
            elif name in sources:
                raise CheckpointError(f"{folder}: {hub!r} and {sources[name].hub!r} both hold {name}")
            else:
                sources[name] = Source(hub=hub, half=half)
    for name, held in experts.items():
        if name in sources:
            raise CheckpointError(f"{folder}: {name} is held both per expert and as {sources[name].hub!r}")
        missing = [e for e in range(num_experts) if e not in held]
        extra = sorted(e for e in held if e >= num_experts)
        if missing or extra:
            what = f"lacks expert {missing[0]}" if missing else f"holds expert {extra[0]}"
            raise CheckpointError(f"{folder}: {name} {what} of {num_experts} (e.g. {next(iter(held.values()))!r}); "
                                  "the experts and config.json's expert count disagree")
        sources[name] = Source(experts=tuple(held[e] for e in range(num_experts)))
    return sources


def mtp_depths(names: list[str], num_layers: int) -> int:
    """How many MTP layers (model.layers.{num_layers + d}) the Hub tensors `names` hold."""
    held = {int(m.group(1)) - num_layers for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= num_layers}
    return max(held) + 1 if held else 0


def stage_canonical(hub: Checkpoint, sources: dict[str, Source], path: str) -> None:
    """Write the tensors of Hub checkpoint `hub` to safetensors `path` under their canonical names:
    experts stacked, fused gate_up_proj split; one tensor in memory at a time."""
    entries = []
    for name, src in sources.items():
        parts = src.experts or (src.hub,)
        dtypes = {hub.entry(h).dtype for h in parts}
        shapes = {tuple(hub.entry(h).shape) for h in parts}
        if len(dtypes) > 1 or len(shapes) > 1:
            raise CheckpointError(f"{hub.folder}: the tensors of {name} mix dtypes or shapes "
                                  f"({sorted(dtypes)}, {sorted(shapes)})")
        shape = shapes.pop()
        if src.experts:
            shape = (len(src.experts),) + shape
        elif src.half is not None:
            if len(shape) != 3 or shape[1] % 2:
                raise CheckpointError(f"{hub.folder}: {src.hub} has shape {shape}; a fused gate_up_proj is "
                                      "(experts, 2 x width, hidden)")
            shape = (shape[0], shape[1] // 2, shape[2])
        entries.append((name, dtypes.pop(), shape))

    def fetch(name: str) -> np.ndarray:
        src = sources[name]
        if src.experts:
            return np.stack([hub.read_full(h) for h in src.experts])
        array = hub.read_full(src.hub)
        if src.half is None:
            return array
        width = array.shape[1] // 2
        return np.ascontiguousarray(array[:, src.half * width:(src.half + 1) * width])

    write_file(path, entries, fetch)
