"""The hardware catalogue: what one accelerator and its node can do, from the vendors' datasheets.

Every figure is per device (one GPU), dense (no 2:4 sparsity), and in SI units (FLOP/s, bytes, bytes/s):

- A100 40GB / 80GB SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s BF16/FP16, 156 TF32;
  HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s (80GB); NVLink 3 600 GB/s total (300 GB/s each way). Nodes:
  NVIDIA DGX A100 datasheet: 8 GPUs on NVSwitch, 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU), 2 TB host RAM.
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOP/s BF16, 494 TF32, 80 GB HBM3 at 3.35 TB/s,
  NVLink 4 900 GB/s total; DGX H100: 8 GPUs, 8x 400 Gb/s ConnectX-7 (50 GB/s per GPU), 2 TB host RAM.
- H200 SXM: NVIDIA H200 datasheet: 989 TFLOP/s BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; HGX H200
  nodes with 400 Gb/s per GPU.
- B200: NVIDIA DGX B200 / HGX B200 datasheets: 72 PFLOP/s FP8 training and 36 PFLOP/s FP16/BF16 (sparse) per
  8 GPUs -> 2.25 PFLOP/s dense BF16 per GPU, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s total, 8x 400 Gb/s.

Achievable fractions are not in datasheets. ``compute_efficiency`` (achieved / peak FLOP/s of a training step's
matmuls) is fitted per GPU generation on published training runs of that generation (``GENERATION_EFFICIENCY``;
``plait.planner.accuracy`` refits it and reports in-sample, leave-one-out and out-of-table errors; the tests hold
these constants to the fit); the memory and link fractions are priors in costs.py. The "this-machine" entry is not in
this table: ``plait calibrate`` measures it (calibrate.py, efficiency 1: it measures what is achieved) and
``get_hardware`` reads it back from the JSON file it wrote.

The network is a list of levels, innermost first (``NetworkLevel``): the catalogue's nodes have two (NVLink inside
a node of 8, the InfiniBand/RoCE share beyond); a custom cluster (``load_hardware_toml``, ``--hardware FILE.toml``)
may describe more (node, leaf switch, spine) with their bandwidth, latency and oversubscription. A collective whose
group spans ``span`` consecutive ranks (plait's rank order: tp innermost) runs at the first level that joins that
many devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

GENERATION_EFFICIENCY = {"ampere": 0.713, "hopper": 0.519, "blackwell": 0.519}
"""Fitted achieved / peak FLOP/s of training matmuls per GPU generation (``plait.planner.accuracy``: the median of
measured / predicted over that generation's fitting tables is 1). Ampere: Narayanan et al. 2021 Table 1; Hopper:
the one-node rows of MosaicML's llm-foundry H100 BF16 table; Blackwell: no published table fitted yet, Hopper's
value assumed. tests/test_planner_validation.py holds these to what ``accuracy.fit()`` gives.

Each is a property of the implementation whose runs it was fitted on, on that generation (``EFFICIENCY_FITTED_ON``),
not of the generation alone: another system on the same GPUs reaches another fraction of the peak (Megatron-Core on
H100s more than Composer's FSDP). A prediction for another implementation borrows it, and says so
(``plait.planner.accuracy``, ``plan()``'s notes); plait's own on a machine comes from ``plait calibrate``."""
EFFICIENCY_FITTED_ON = {"ampere": "megatron", "hopper": "composer", "blackwell": "composer"}
"""The implementation family (``costs.Implementation.family``) whose published runs each generation's efficiency
was fitted on: Megatron-LM 2021 on A100s, MosaicML's Composer (FSDP) on H100s; Blackwell borrows Hopper's."""

TB = 1e12
GB = 1e9
GIB = 2**30

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
"""The collectives the cost model times (the same names as ``plait.comm.Comm``'s methods)."""


@dataclass(frozen=True)
class NetworkLevel:
    """One level of the network, innermost first: it joins ``devices`` devices (0: all of them) with
    ``bandwidth`` bytes/s per device in one direction, ``latency`` seconds per message step, and
    ``oversubscription`` (uplink bandwidth shared by that many devices' worth of traffic: bandwidth / it)."""

    name: str
    devices: int
    bandwidth: float
    latency: float
    oversubscription: float = 1.0

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth / self.oversubscription


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the node it sits in.

    Attributes:
        name: catalogue key.
        peak_flops: dense matmul FLOP/s by precision ("bf16", "fp16", "fp32"; fp32 means TF32 tensor cores on GPUs).
        memory_bytes: device memory (HBM) in bytes.
        memory_bandwidth: device memory bandwidth, bytes/s.
        intra_node_bandwidth: one direction of one device's links inside a node (NVLink), bytes/s.
        inter_node_bandwidth: one device's share of the node's network (InfiniBand/RoCE), bytes/s.
        devices_per_node: devices joined by the intra-node fabric.
        intra_node_latency / inter_node_latency: alpha of the alpha-beta model, seconds per message step.
        host_bandwidth: device <-> host copies (PCIe), bytes/s per device (offload traffic).
        host_memory_bytes: host RAM per device (the node's RAM / devices_per_node), for offloaded states.
        host_memory_bandwidth: one device's share of host DRAM bandwidth (CPU Adam under offload; DGX A100: 2 x 8
            channels of DDR4-3200 = 410 GB/s per node).
        nvme_bandwidth: NVMe read/write bandwidth per device (an assumption: one PCIe 4 drive per GPU).
        measured: per collective, a fitted ``(alpha_s, beta_s_per_byte)`` of its payload (``plait calibrate``);
            when present it replaces the link model for that collective inside a node.
        measured_ranks: the group size the ``measured`` fits were taken at; other group sizes scale them by the
            ring formulas' latency and bandwidth factors (``costs.collective_time``).
        block_overhead: seconds a transformer block's forward + backward costs whatever its size (CPU: Python,
            dispatcher, autograd; measured by ``plait calibrate``), paid per block and micro-batch; 0 on GPUs
            (kernel launches run ahead of the device).
        compute_units: processors that all ranks share (``plait calibrate``: how many single-thread matmuls run
            at once at full speed on this machine); 0 means every rank has its own device (GPUs).
        split_backward: zero-bubble's input-gradient pass I plus weight-gradient pass W over one backward B
            (Qi et al. 2023 count I + W = B: 1.0 on GPUs; ``plait calibrate`` measures plait's two autograd passes
            on CPU, where the second traversal of the graph costs extra).
        generation: the GPU generation ("ampere", "hopper", "blackwell"; "" for a measured machine).
        compute_efficiency: achieved / peak FLOP/s of a training step's matmuls (module docstring): fitted per
            generation for the catalogue, 1.0 for a calibrated machine.
        levels: the network, innermost first (``NetworkLevel``); empty: two levels from the intra/inter fields.
        source: where the figures come from.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 1e-5
    host_bandwidth: float = 25 * GB
    host_memory_bytes: float = 256 * GB
    host_memory_bandwidth: float = 50 * GB
    nvme_bandwidth: float = 6 * GB
    measured: dict[str, tuple[float, float]] = field(default_factory=dict)
    measured_ranks: int = 2
    block_overhead: float = 0.0
    compute_units: float = 0.0
    split_backward: float = 1.0
    generation: str = ""
    compute_efficiency: float = 1.0
    levels: tuple[NetworkLevel, ...] = ()
    source: str = ""

    def flops(self, precision: str) -> float:
        """Peak dense matmul FLOP/s at ``precision`` (a ``Layout.precision``)."""
        if precision not in self.peak_flops:
            raise ConfigError(
                f"{self.name} has no peak FLOP/s for precision {precision!r}. "
                f"Fix: use one of {', '.join(self.peak_flops)}."
            )
        return self.peak_flops[precision]

    def network(self) -> tuple[NetworkLevel, ...]:
        """The levels, innermost first (the two of a catalogue node when ``levels`` is empty)."""
        if self.levels:
            return self.levels
        return (
            NetworkLevel("node", self.devices_per_node, self.intra_node_bandwidth, self.intra_node_latency),
            NetworkLevel("network", 0, self.inter_node_bandwidth, self.inter_node_latency),
        )

    def level(self, span: int) -> NetworkLevel:
        """The innermost level that joins ``span`` consecutive devices."""
        levels = self.network()
        return next((lv for lv in levels if lv.devices == 0 or span <= lv.devices), levels[-1])

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["measured"] = {op: list(fit) for op, fit in self.measured.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        data = dict(data)
        data["measured"] = {op: tuple(fit) for op, fit in data.get("measured", {}).items()}
        data["levels"] = tuple(NetworkLevel(**level) for level in data.get("levels", ()))
        return cls(**data)


def _gpu(
    name: str,
    bf16_tflops: float,
    tf32_tflops: float,
    memory_gb: float,
    hbm_tb_s: float,
    nvlink_gb_s: float,
    network_gbit_s: float,
    pcie_gb_s: float,
    host_tb_per_node: float,
    generation: str,
    source: str,
) -> Hardware:
    return Hardware(
        name=name,
        peak_flops={"bf16": bf16_tflops * TB, "fp16": bf16_tflops * TB, "fp32": tf32_tflops * TB},
        memory_bytes=memory_gb * GB,
        memory_bandwidth=hbm_tb_s * TB,
        intra_node_bandwidth=nvlink_gb_s / 2 * GB,  # datasheets give both directions together
        inter_node_bandwidth=network_gbit_s / 8 * GB,
        devices_per_node=8,
        host_bandwidth=pcie_gb_s * GB,
        host_memory_bytes=host_tb_per_node * TB / 8,
        generation=generation,
        compute_efficiency=GENERATION_EFFICIENCY[generation],
        source=source,
    )


CATALOGUE: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        _gpu("a100-40gb", 312, 156, 40, 1.555, 600, 200, 25, 1, "ampere", "NVIDIA A100 datasheet; DGX A100 datasheet"),
        _gpu(
            "a100-80gb",
            312,
            156,
            80,
            2.039,
            600,
            200,
            25,
            2,
            "ampere",
            "NVIDIA A100 80GB datasheet; DGX A100 datasheet",
        ),
        _gpu("h100", 989, 494, 80, 3.35, 900, 400, 50, 2, "hopper", "NVIDIA H100 SXM5 datasheet; DGX H100 datasheet"),
        _gpu("h200", 989, 494, 141, 4.8, 900, 400, 50, 2, "hopper", "NVIDIA H200 SXM datasheet; HGX H200"),
        _gpu("b200", 2250, 1100, 180, 8.0, 1800, 400, 50, 2, "blackwell", "NVIDIA DGX B200 / HGX B200 datasheets"),
    )
}
ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h100-80gb": "h100", "h200-sxm": "h200"}
THIS_MACHINE = "this-machine"


def calibration_path() -> Path:
    """Where ``plait calibrate`` writes and ``get_hardware("this-machine")`` reads: $PLAIT_CALIBRATION, else
    ~/.cache/plait/calibration.json."""
    env = os.environ.get("PLAIT_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "plait" / "calibration.json"


def get_hardware(name: str | Path | Hardware) -> Hardware:
    """The catalogue entry called ``name`` (case-insensitive; aliases such as "a100"), this machine's
    calibration, or a cluster described in a TOML file (a path ending in .toml: ``load_hardware_toml``). Unknown
    names raise ConfigError listing the options."""
    if isinstance(name, Hardware):
        return name
    if str(name).endswith(".toml"):
        from plait.planner.hardware_file import load_hardware_toml

        return load_hardware_toml(name)
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key in CATALOGUE:
        return CATALOGUE[key]
    if key == THIS_MACHINE:
        path = calibration_path()
        if not path.is_file():
            raise ConfigError(
                f"no calibration of this machine at {path}. Fix: run `plait calibrate` first "
                f"(a few seconds), or pick one of {', '.join(CATALOGUE)}."
            )
        return Hardware.from_dict(json.loads(path.read_text())["hardware"])
    options = ", ".join([*CATALOGUE, THIS_MACHINE])
    raise ConfigError(
        f"unknown GPU {name!r}. Fix: use one of {options} (aliases: {', '.join(ALIASES)}), or describe your "
        f"cluster in a TOML file (--hardware FILE.toml; docs/planner.md)."
    )


__all__ = [
    "CATALOGUE",
    "COLLECTIVES",
    "EFFICIENCY_FITTED_ON",
    "GENERATION_EFFICIENCY",
    "GIB",
    "Hardware",
    "NetworkLevel",
    "THIS_MACHINE",
    "calibration_path",
    "get_hardware",
]
