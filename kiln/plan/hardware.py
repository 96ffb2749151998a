"""The GPUs and interconnects the planner knows, with where each number comes from.

Peaks are dense (no sparsity) bf16 tensor-core rates from the vendors' data sheets, the same as
kiln/metrics/mfu.py's (a test holds the two equal). Memory is the data sheet's capacity.
Bandwidths are per GPU and per direction: NVLink's data-sheet figure is both directions added,
so it is halved here; a network's is the port rate of the one NIC each GPU has in the usual
HGX/DGX node (8 bits to the byte).

Two constants are measured rather than read off a data sheet, each from one published run
(benchmarks/planner.md names them; every other row of that comparison is held out):
`COMPUTE_EFFICIENCY`, the share of the dense peak a training step's compute reaches on one GPU,
and `NVLINK_EFFICIENCY`, the share of NVLink's nominal rate tensor parallel's collectives reach.
`NETWORK_EFFICIENCY` is an assumption, not a fit: NCCL's all-gather and reduce-scatter bus
bandwidth over InfiniBand is commonly about 80% of the line rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction, to the other GPUs of its node
    network: str  # the usual inter-node interconnect for this GPU (a key of INTERCONNECTS)


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_s: float  # per GPU, per direction
    source: str


# Data sheets: NVIDIA H100 (SXM5: 989.4 TFLOP/s bf16 dense, 80 GB, NVLink 4 900 GB/s), H200
# (SXM: 989 TFLOP/s, 141 GB, NVLink 900 GB/s), A100 (SXM4 80 GB: 312 TFLOP/s, NVLink 3
# 600 GB/s), B200 (HGX B200: 2.25 PFLOP/s bf16 dense, 180 GB per GPU, NVLink 5 1.8 TB/s).
GPUS = {
    "h100": Gpu("H100 SXM", 989e12, 80 * GB, 450 * GB, "ndr"),
    "h200": Gpu("H200 SXM", 989e12, 141 * GB, 450 * GB, "ndr"),
    "a100": Gpu("A100 SXM 80GB", 312e12, 80 * GB, 300 * GB, "hdr"),
    "b200": Gpu("B200", 2250e12, 180 * GB, 900 * GB, "ndr"),
}

INTERCONNECTS = {
    "nvlink": Interconnect("NVLink (the GPU's own generation)", 0.0, "GPU data sheet, halved"),
    "ndr": Interconnect("InfiniBand NDR", 400e9 / 8, "400 Gb/s per port, one port per GPU"),
    "hdr": Interconnect("InfiniBand HDR", 200e9 / 8, "200 Gb/s per port, one port per GPU"),
    "ethernet": Interconnect("Ethernet (RoCE) 100 GbE", 100e9 / 8, "100 Gb/s per GPU"),
}

# Calibrated, one published run each (benchmarks/planner.md, "calibration" rows):
# the 7B model on one H200 (57.8% MFU in the publisher's FLOP count, full AC): the share of the
# peak that kiln's honest FLOPs plus the recompute reach when nothing communicates;
COMPUTE_EFFICIENCY = 0.69
# 7B on 4 H200s as TP=4 (34.7% MFU against 53.8% for FSDP=4): what the TP collectives, which
# wait on each other every layer, reach of NVLink's nominal rate.
NVLINK_EFFICIENCY = 0.33
# Assumed: NCCL's bus bandwidth over InfiniBand, about 80% of the line rate.
NETWORK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is for: `gpus` GPUs of one kind, `gpus_per_node` to a node."""

    gpu: Gpu
    gpus: int
    gpus_per_node: int
    network: Interconnect

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def bandwidth(self, span: int) -> float:
        """Achieved bytes/s per GPU of a collective whose ranks lie `span` consecutive ranks
        apart at most: inside a node on NVLink, else bound by the network."""
        if span <= self.gpus_per_node:
            return self.gpu.nvlink_bytes_per_s * NVLINK_EFFICIENCY
        return self.network.bytes_per_s * NETWORK_EFFICIENCY


def known_gpus() -> str:
    return ", ".join(GPUS)


def find_gpu(
    name: str,
    *,
    peak_tflops: float | None = None,
    memory_gb: float | None = None,
    nvlink_gbps: float | None = None,
) -> Gpu:
    """The table's GPU `name`, with any of its numbers replaced; a GPU not in the table needs all
    three given."""
    key = name.lower().replace("-", "").replace(" ", "")
    given = (peak_tflops, memory_gb, nvlink_gbps)
    if key not in GPUS:
        if None in given:
            raise ConfigError(
                f"unknown GPU {name!r}: the planner knows {known_gpus()}. For another GPU give "
                "its numbers: --peak-tflops (dense bf16), --memory-gb and --nvlink-gbps (GB/s "
                "per direction to the other GPUs of a node), e.g. --gpu l40s --peak-tflops 362 "
                "--memory-gb 48 --nvlink-gbps 32"
            )
        return Gpu(name, peak_tflops * 1e12, memory_gb * GB, nvlink_gbps * GB, "ndr")
    gpu = GPUS[key]
    return Gpu(
        gpu.name,
        gpu.peak_flops if peak_tflops is None else peak_tflops * 1e12,
        gpu.memory_bytes if memory_gb is None else memory_gb * GB,
        gpu.nvlink_bytes_per_s if nvlink_gbps is None else nvlink_gbps * GB,
        gpu.network,
    )


def make_cluster(gpu: Gpu, gpus: int, gpus_per_node: int, network: str | None = None) -> Cluster:
    """Check the counts and the network name; one message per mistake."""
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError(
            f"--gpus and --gpus-per-node must be positive, got {gpus}, {gpus_per_node}"
        )
    if gpus % gpus_per_node and gpus > gpus_per_node:
        below = gpus // gpus_per_node * gpus_per_node
        raise ConfigError(
            f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}: whole nodes "
            f"only; use {below} or {below + gpus_per_node} GPUs, or another --gpus-per-node"
        )
    key = network or gpu.network
    if key not in INTERCONNECTS or key == "nvlink":
        known = ", ".join(k for k in INTERCONNECTS if k != "nvlink")
        raise ConfigError(f"unknown --network {key!r}: the planner knows {known}")
    return Cluster(gpu, gpus, min(gpus_per_node, gpus), INTERCONNECTS[key])
