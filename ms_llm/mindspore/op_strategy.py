"""Op shard strategies as MindSpore takes them, computed from the plan's TensorLayouts: split
counts where MindSpore's default device matrix puts the ranks where the mesh does, a Layout over
the named mesh otherwise. lower.py (dense layers, MTP), lower_mla.py (multi-latent attention) and
lower_moe.py (MoE layers) build on these; nothing here imports MindSpore until a Layout is built."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from ms_llm.strategy.layout import Replicate, Shard, TensorLayout


@dataclass(frozen=True)
class LayoutStrategy:
    """A mindspore.parallel.Layout: device matrix with axis names, and the axes splitting each dim."""
    dev_matrix: tuple[int, ...]
    names: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]          # () = dim not split

    def aliases(self) -> tuple:
        return tuple("None" if not d else d[0] if len(d) == 1 else d for d in self.dims)

    def build(self):
        from mindspore.parallel import Layout
        return Layout(self.dev_matrix, self.names)(*self.aliases())

    def __str__(self) -> str:
        dev = ",".join(f"{n}{s}" for n, s in zip(self.names, self.dev_matrix))
        return f"Layout({dev})(" + ", ".join("(" + ",".join(a) + ")" if isinstance(a, tuple) else a
                                            for a in self.aliases()) + ")"


Strategy = Union[tuple[int, ...], LayoutStrategy]


def _split_axes(layout: TensorLayout) -> list[str]:
    return [a for d in range(len(layout.shape)) for a in layout.axes_of(d) if layout.mesh.axis_size(a) > 1]


def as_layout(layout: TensorLayout) -> LayoutStrategy:
    names = tuple(a for a in layout.mesh.names if layout.mesh.axis_size(a) > 1) or (layout.mesh.names[-1],)
    dims = tuple(tuple(a for a in layout.axes_of(d) if a in names and layout.mesh.axis_size(a) > 1)
                 for d in range(len(layout.shape)))
    return LayoutStrategy(tuple(layout.mesh.axis_size(a) for a in names), names, dims)


def strategy_of(layout: TensorLayout) -> Strategy:
    """Split counts when the splitting axes, read in dim order, are in mesh order; else a Layout."""
    split = _split_axes(layout)
    if split == [a for a in layout.mesh.names if a in split]:
        return layout.ms_strategy()
    return as_layout(layout)


def flat_tokens(layout: TensorLayout) -> TensorLayout:
    """(..., last) -> (tokens, last): what a Linear's 2-D MatMul sees."""
    n = len(layout.shape)
    return layout.group_dims((tuple(range(n - 1)), (n - 1,)))


def select(layout: TensorLayout, dims: tuple[int, ...]) -> TensorLayout:
    """Layout of a tensor made of `dims` of `layout` (broadcast operands such as rotary tables, masks)."""
    placements = tuple(Shard(dims.index(p.dim)) if isinstance(p, Shard) and p.dim in dims else Replicate()
                       for p in layout.placements)
    return TensorLayout(tuple(layout.shape[d] for d in dims), layout.mesh, placements, layout.order)


def reshaped(layout: TensorLayout, shape: tuple[int, ...]) -> TensorLayout:
    """The same placements on a tensor of another shape whose split dims keep their place: a slice,
    or trailing dims changed (a per-token tensor of another width)."""
    return TensorLayout(tuple(shape), layout.mesh, layout.placements, layout.order)


def whole_over(layout: TensorLayout, axis: str) -> TensorLayout:
    """The layout gathered over mesh axis `axis` (a column-parallel matmul reads its input whole over tp)."""
    placements = tuple(Replicate() if n == axis else p for n, p in zip(layout.mesh.names, layout.placements))
    return TensorLayout(layout.shape, layout.mesh, placements, layout.order)


@dataclass(frozen=True)
class OpShard:
    """One primitive's shard(): `op` is its attribute path in LossCell(Transformer) minus `net.`;
    `attrs` are primitive attributes the parallel passes read (add_prim_attr), set with it;
    `layouts` the TensorLayouts the strategies were computed from (inputs, then the output; None
    for a scalar): what each strategy means rank by rank, whichever form MindSpore is given."""
    op: str
    inputs: tuple[Strategy | tuple[()], ...]
    output: Optional[tuple[Strategy, ...]] = None
    attrs: tuple[tuple[str, object], ...] = ()
    layouts: tuple[Optional[TensorLayout], ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        def fmt(s):
            return str(s) if isinstance(s, LayoutStrategy) else str(tuple(s))
        def group(items):                      # the Python tuple shard() receives
            return "(" + ", ".join(fmt(s) for s in items) + ("," if len(items) == 1 else "") + ")"
        text = f"{self.op}: in {group(self.inputs)}"
        if self.output is not None:
            text += f" out {group(self.output)}"
        if self.attrs:
            text += " attrs " + ", ".join(f"{k}={v}" for k, v in self.attrs)
        return text


def op_shard(op: str, inputs: list[TensorLayout | None], output: Optional[TensorLayout] = None,
        attrs: tuple[tuple[str, object], ...] = ()) -> OpShard:
    """Strategies for one op; None is a scalar operand. MindSpore takes all-tuples or all-Layouts
    per op, so one operand that needs a Layout makes every operand a Layout."""
    layouts = [l for l in inputs + [output] if l is not None]
    lift = any(isinstance(strategy_of(l), LayoutStrategy) for l in layouts)
    conv = as_layout if lift else strategy_of
    ins = tuple(() if l is None else conv(l) for l in inputs)
    return OpShard(op, ins, None if output is None else (conv(output),), attrs, tuple(inputs) + (output,))


def norm_ops(prefix: str, x: TensorLayout, weight: TensorLayout) -> list[OpShard]:
    """RMSNorm's primitives (layers.RMSNorm), all in the layout of the normed tensor."""
    return [op_shard(prefix + "square", [x]), op_shard(prefix + "mean", [x]), op_shard(prefix + "add", [x, None]),
            op_shard(prefix + "rsqrt", [x]), op_shard(prefix + "mul", [x, x]), op_shard(prefix + "mul2", [x, weight])]
