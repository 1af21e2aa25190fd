"""Cloud TPU slices: chips, hosts, HBM per chip, and the gcloud names of each generation.

A slice is named like gcloud names its accelerator type: `v5p-32`, `v6e-8`, `v5litepod-16`
(also written `v5e-16`). The number counts TensorCores for v5p (two per chip, one JAX device
per chip) and chips for v5e and v6e (one TensorCore each), so `v5p-32` is 16 chips on 4 hosts
and `v5e-8` is 8 chips on one host.
"""

from __future__ import annotations

import dataclasses
import re

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # 'v5e', 'v5p', 'v6e'
    gcloud_type: str  # accelerator-type prefix gcloud expects ('v5litepod', 'v5p', 'v6e')
    runtime_version: str  # TPU VM software version for JAX
    hbm_gib: float  # HBM per chip
    cores_per_chip: int  # TensorCores per chip (what the slice name counts for v5p)
    chips_per_host: int  # chips per VM in a multi-host slice
    single_host_chips: int  # chips of the largest single-host slice
    sizes: tuple[int, ...]  # slice sizes gcloud offers, in the name's unit

    def chips(self, size: int) -> int:
        return size // self.cores_per_chip if self.name == "v5p" else size


_V5P_SIZES = tuple(8 * k for k in range(1, 1537))  # v5p-8 ... v5p-12288, multiples of 8 cores

GENERATIONS: dict[str, Generation] = {
    "v5e": Generation(
        "v5e", "v5litepod", "v2-alpha-tpuv5-lite", 16.0, 1, 4, 8, (1, 4, 8, 16, 32, 64, 128, 256)
    ),
    "v5p": Generation("v5p", "v5p", "v2-alpha-tpuv5", 95.0, 2, 4, 4, _V5P_SIZES),
    "v6e": Generation(
        "v6e", "v6e", "v2-alpha-tpuv6e", 32.0, 1, 4, 8, (1, 4, 8, 16, 32, 64, 128, 256)
    ),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e"}


@dataclasses.dataclass(frozen=True)
class Topology:
    """One TPU slice. `devices` is the JAX device count (one per chip)."""

    name: str  # canonical, as gcloud's --accelerator-type: 'v5litepod-8', 'v5p-32', 'v6e-8'
    generation: Generation
    size: int  # the number in the name
    chips: int
    hosts: int
    hbm_bytes: int  # per chip / JAX device

    @property
    def devices(self) -> int:
        return self.chips

    @property
    def short_name(self) -> str:
        return f"{self.generation.name}-{self.size}"

    def describe(self) -> str:
        hosts = "1 host" if self.hosts == 1 else f"{self.hosts} hosts"
        return (
            f"{self.short_name} ({self.name}): {self.chips} chips x "
            f"{self.hbm_bytes / GIB:.0f} GiB HBM, {hosts}"
        )


def parse_topology(name: str, hbm_gib: float | None = None) -> Topology:
    """'v5p-32' / 'v5litepod-8' / 'v5e-8' / 'v6e-16' -> Topology; ValueError names what is wrong.

    hbm_gib overrides the generation's HBM per chip (e.g. to plan with headroom).
    """
    m = re.fullmatch(r"\s*([a-z0-9]+)-(\d+)\s*", str(name).lower())
    if not m or m.group(1) not in _ALIASES:
        known = ", ".join(f"{g}-N" for g in GENERATIONS)
        raise ValueError(
            f"topology {name!r}: expected <generation>-<size> with generation one of {known} "
            "(or v5litepod-N), e.g. v5p-32, v5e-8, v6e-8"
        )
    gen = GENERATIONS[_ALIASES[m.group(1)]]
    size = int(m.group(2))
    if size not in gen.sizes:
        shown = gen.sizes if len(gen.sizes) < 20 else "multiples of 8 from 8 to 12288"
        raise ValueError(f"topology {name!r}: {gen.name} slices come in sizes {shown}")
    chips = gen.chips(size)
    hosts = 1 if chips <= gen.single_host_chips else chips // gen.chips_per_host
    hbm = gen.hbm_gib if hbm_gib is None else float(hbm_gib)
    if not hbm > 0:
        raise ValueError(f"HBM per chip must be > 0 GiB, got {hbm_gib!r}")
    return Topology(f"{gen.gcloud_type}-{size}", gen, size, chips, hosts, int(hbm * GIB))
