"""Device spec table for the cost model. Peak dense bf16/fp16 FLOP/s from vendor sheets;
bandwidths are per device, one direction."""
from __future__ import annotations

from dataclasses import dataclass

from ms_llm.errors import ConfigError

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    peak_flops: float          # dense bf16 (fp16 on Ascend) FLOP/s
    memory_bytes: float        # device memory
    hbm_bandwidth: float       # bytes/s
    intra_node_bw: float       # bytes/s per device inside a node (NVLink / HCCS)
    inter_node_bw: float       # bytes/s per device across nodes (IB / RoCE)
    devices_per_node: int
    matmul_efficiency: float   # achievable fraction of peak on large GEMMs


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(name="NVIDIA H100 SXM 80GB", peak_flops=989e12, memory_bytes=80 * GB,
                       hbm_bandwidth=3.35e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB,
                       devices_per_node=8, matmul_efficiency=0.62),
    # H800: the H100 SXM with its NVLink cut to 400 GB/s both ways (DeepSeek-V3 measured ~160 GB/s of
    # it) and 8 x 400 Gb/s InfiniBand per node, as DeepSeek-V3 trained on. 1979 TFLOP/s in FP8.
    "h800": DeviceSpec(name="NVIDIA H800 SXM 80GB", peak_flops=989e12, memory_bytes=80 * GB,
                       hbm_bandwidth=3.35e12, intra_node_bw=200 * GB, inter_node_bw=50 * GB,
                       devices_per_node=8, matmul_efficiency=0.62),
    "h200": DeviceSpec(name="NVIDIA H200 SXM 141GB", peak_flops=989e12, memory_bytes=141 * GB,
                       hbm_bandwidth=4.8e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB,
                       devices_per_node=8, matmul_efficiency=0.64),
    "a100": DeviceSpec(name="NVIDIA A100 SXM 80GB", peak_flops=312e12, memory_bytes=80 * GB,
                       hbm_bandwidth=2.04e12, intra_node_bw=300 * GB, inter_node_bw=25 * GB,
                       devices_per_node=8, matmul_efficiency=0.70),
    "910b": DeviceSpec(name="Ascend 910B (Atlas 800T A2) 64GB", peak_flops=313e12, memory_bytes=64 * GB,
                       hbm_bandwidth=1.6e12, intra_node_bw=196 * GB, inter_node_bw=25 * GB,
                       devices_per_node=8, matmul_efficiency=0.60),
    "cpu": DeviceSpec(name="CPU core (development)", peak_flops=0.1e12, memory_bytes=24 * GB,
                      hbm_bandwidth=20 * GB, intra_node_bw=5 * GB, inter_node_bw=1 * GB,
                      devices_per_node=2, matmul_efficiency=0.5),
}


def get_device(name: str) -> DeviceSpec:
    key = name.lower().replace("ascend", "").replace("-", "").replace("_", "").strip()
    if key not in DEVICES:
        raise ConfigError(f"--device: unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]
