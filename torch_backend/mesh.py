"""The plan's named mesh as a torch DeviceMesh, with every derived axis flattened once.

torch's DeviceMesh uses the same row-major rank order as ms_llm.strategy.mesh, so mesh
rank r is global rank r and no remapping happens here. Derived axes (dp, dp_cp, ...) are
flattened at build time and kept in a dict: torch wants callers to hold flattened meshes
themselves rather than slice them back out of the root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ms_llm.strategy.mesh import DERIVED_AXES, MeshSpec


@dataclass
class Meshes:
    """The world mesh plus 1-D (or flattened) sub-meshes by axis name."""
    spec: MeshSpec
    world: DeviceMesh
    derived: dict[str, DeviceMesh] = field(default_factory=dict)
    expert: Optional[DeviceMesh] = None     # pp x edp x ep x etp (ms_llm.strategy.mesh.EXPERT_AXES), MoE only

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.derived:
            return self.derived[name]
        return self.world[name]

    def size(self, name: str) -> int:
        return self.spec.axis_size(name)

    def coord(self, name: str) -> int:
        """This rank's position along (possibly derived) axis `name`."""
        return self.spec.index_in(name, dist.get_rank())

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def expert_group(self, name: str) -> dist.ProcessGroup:
        """'ep' (ranks splitting the experts), 'etp' (ranks splitting each expert's width) or 'edp'
        (ranks holding the same expert shard)."""
        return self.expert[name].get_group()


def build_meshes(spec: MeshSpec, device_type: str, expert: Optional[MeshSpec] = None) -> Meshes:
    """init_device_mesh over the plan's axes (size-1 axes included, so every name exists),
    then flatten each derived axis of DERIVED_AXES. `expert`: the plan's expert mesh, the same
    ranks in the same order with each stage's dp*cp*tp read as (edp, ep, etp), etp innermost
    (Megatron's expert groups)."""
    world = init_device_mesh(device_type, spec.shape, mesh_dim_names=spec.names)
    meshes = Meshes(spec, world)
    if expert is not None:
        meshes.expert = init_device_mesh(device_type, expert.shape, mesh_dim_names=expert.names)
    for name, axes in DERIVED_AXES.items():
        if all(a in spec.names for a in axes):
            meshes.derived[name] = world[axes]._flatten(name)
    return meshes
