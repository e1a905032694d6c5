"""TPU slices for `grpo-run --plan --target NAME`: compile for a TPU topology on any host.

libtpu (the `tpu` extra) builds compile-only devices for a topology with no TPU
attached; a mesh built on them makes every `.lower(...).compile()` run the TPU
compiler, whose buffer assignment is then the plan's figures.

A slice name is `<generation>-<N>` as Cloud TPU names them; N counts chips on v5e/v6e
and TensorCores on v4/v5p, whose two cores per chip form one megacore device. Slices
of up to 8 (v5e/v6e) or 4 (v4/v5p) chips sit on one host; larger ones have 4 chips
(2x2) per host, so v6e-8 = 8 devices on 1 host, v6e-16 = 16 devices on 4 hosts and
v4-16 = 8 devices on 2 hosts. A raw topology `v6e:4x4` is accepted as well.

Several slices joined by the data-center network (DCN): `2xv6e-8` or `v6e-8x2` (also
`2xv6e:2x4`); libtpu then describes every slice's devices, each with its `slice_index`, and the
run's mesh must have as many `mesh.slices`.
"""

from __future__ import annotations

import importlib.util
import math
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from grpo_core.errors import UserError

from grpo_runner_gsm8k.environ import environment, unset

INSTALL_HINT = ("install the TPU compiler: `uv sync --group tpu` in the grpo-jax checkout, or "
                "`pip install 'grpo-runner-gsm8k[tpu]'`")

# Per chip, from the Cloud TPU documentation (cloud.google.com/tpu/docs/v4, /v5e, /v5p-training, /v6e):
# | chip | bf16 peak    | HBM     | usable HBM | HBM bandwidth | ICI bandwidth (bidirectional) |
# | v4   | 275 TFLOP/s  | 32 GiB  | 32 GiB *   | 1200 GB/s     | 600 GB/s **                   |
# | v5e  | 197 TFLOP/s  | 16 GB   | 15.75 GiB  | 819 GB/s      | 400 GB/s                      |
# | v5p  | 459 TFLOP/s  | 95 GiB  | 95 GiB *   | 2765 GB/s     | 1200 GB/s                     |
# | v6e  | 918 TFLOP/s  | 32 GB   | 31.25 GiB  | 1638 GB/s     | 800 GB/s                      |
# Usable: the `bytes_limit` a chip's runtime reports (the runtime keeps the rest): 31.25 GiB on the
# v6e-8 runs of this project, 16,909,332,480 B on v5e; * no reported figure known, the nominal size.
# ** not on the v4 page: 6 ICI links of 50 GB/s each way (TPU v4 paper, ISCA 2023).
HBM_SOURCE = "cloud.google.com/tpu/docs/v4, /v5e, /v5p-training, /v6e (per chip)"
# Collective latency: what one collective costs besides its bytes over the ICI bandwidth. No
# generation's documentation publishes one (they give bandwidths only), so the figure is derived,
# and labelled so wherever it is shown: a ring collective over the chips of the largest single-host
# slice steps through half the ring on a bidirectional ring (4 hops on 8 chips: v5e, v6e; 2 on the
# 2x2 of v4, v5p), each hop taken as 1 us (link, DMA issue and the step's synchronisation), plus
# 1 us to issue the collective: 5 us and 3 us. A conservative (high) reading of "a few
# microseconds"; `--chip collective_latency_us=X` replaces it, and the plan prints the step at half
# and double the figure.
LATENCY_SOURCE = "derived: (hops of a ring over the single-host slice / 2) x 1 us + 1 us issue; no published figure"
# Between slices, per host: the v5e page's "per-host NIC configuration: 2 x 100 Gbps NIC"
# (cloud.google.com/tpu/docs/v5e) = 25 GB/s, shared by the host's chips. The v4, v5p and v6e pages
# publish no per-host figure; they get the same 25 GB/s, labelled so. The latency of a collective over
# the DCN is not published either: 20 us is assumed (hosts a data-center hop apart, against a few us
# over ICI). `--chip dcn_host_gbps=X,dcn_latency_us=Y` replaces them.
DCN_GBPS, DCN_LATENCY_US = 25.0, 20.0
DCN_SOURCE = {"v5e": "2 x 100 Gbps NICs per host, cloud.google.com/tpu/docs/v5e"}
DCN_ASSUMED = "not published: v5e's 2 x 100 Gbps NICs per host assumed"
DCN_LATENCY_SOURCE = "assumed, no published figure"
CHIP_FIELDS = ("peak_tflops", "hbm_gbps", "ici_gbps", "usable_hbm_gib", "collective_latency_us", "dcn_host_gbps",
               "dcn_latency_us")


@dataclass(frozen=True)
class Generation:
    name: str
    hbm_gib: float  # nominal per chip
    dims: int  # topology rank: 2 (v5e, v6e) or 3 (v4, v5p)
    megacore: bool  # two TensorCores per chip act as one device; N in the name counts cores
    single_host_chips: int  # the largest slice that fits on one host
    sizes: tuple[int, ...]  # the N of the slice names offered
    peak_tflops: float  # bf16 matmul peak per chip
    hbm_gbps: float  # HBM bandwidth per chip, GB/s
    ici_gbps: float  # inter-chip interconnect bandwidth per chip, both directions, GB/s
    usable_hbm_gib: float  # what a program may allocate (see the table)
    usable_source: str
    collective_latency_us: float  # per collective, besides its bytes over ici_gbps (derived, see above)
    latency_source: str = LATENCY_SOURCE
    dcn_host_gbps: float = DCN_GBPS  # data-center network per host, GB/s (see above)
    dcn_latency_us: float = DCN_LATENCY_US  # per collective across slices, besides its bytes
    dcn_source: str = DCN_ASSUMED
    dcn_latency_source: str = DCN_LATENCY_SOURCE
    host_chips: int = 1  # chips sharing a host's DCN bandwidth: set from the target (parse_target)


GENERATIONS = {
    "v4": Generation("v4", 32.0, 3, True, 4, (8, 16, 32, 64, 128, 256, 512), 275.0, 1200.0, 600.0, 32.0,
                     "nominal HBM, no reported bytes_limit known", 3.0),
    "v5e": Generation("v5e", 16.0, 2, False, 8, (1, 4, 8, 16, 32, 64, 128, 256), 197.0, 819.0, 400.0,
                      16909332480 / (1 << 30), "the bytes_limit a v5e chip reports", 5.0,
                      dcn_source=DCN_SOURCE["v5e"]),
    "v5p": Generation("v5p", 95.0, 3, True, 4, (8, 16, 32, 64, 128, 256, 512), 459.0, 2765.0, 1200.0, 95.0,
                      "nominal HBM, no reported bytes_limit known", 3.0),
    "v6e": Generation("v6e", 32.0, 2, False, 8, (1, 4, 8, 16, 32, 64, 128, 256), 918.0, 1638.0, 800.0, 31.25,
                      "the bytes_limit v6e-8 chips report", 5.0),
}
MULTI_HOST_CHIPS = (2, 2, 1)  # chips per host of every multi-host slice
# jax's device_kind of each generation's chips
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def generation_of(device: Any) -> Optional[Generation]:
    """The table's generation of a TPU device (None for other devices or an unknown kind)."""
    name = DEVICE_KINDS.get(getattr(device, "device_kind", ""))
    return GENERATIONS[name] if device.platform == "tpu" and name else None


@dataclass(frozen=True)
class Target:
    name: str  # as the user gave it
    generation: Generation
    topology: tuple[int, ...]  # chips per dimension, of one slice
    slices: int = 1  # slices joined by the data-center network

    @property
    def chips(self) -> int:
        return math.prod(self.topology)

    @property
    def topology_name(self) -> str:
        return f"{self.generation.name}:" + "x".join(map(str, self.topology))

    @property
    def accelerator_type(self) -> str:
        """The slice name Cloud TPU would give this topology (v4-16 for v4:2x2x2)."""
        return f"{self.generation.name}-{self.chips * (2 if self.generation.megacore else 1)}"

    @property
    def chips_per_host(self) -> tuple[int, ...]:
        if self.chips <= self.generation.single_host_chips:
            return self.topology + (1,) * (3 - len(self.topology))
        return MULTI_HOST_CHIPS


def valid_names() -> str:
    return ", ".join(f"{g.name}-{{{','.join(map(str, g.sizes))}}}" for g in GENERATIONS.values())


def _bad_target(name: str, why: str) -> UserError:
    return UserError(f"--target {name!r}: {why}; give a slice ({valid_names()}) or a topology such as "
                     "'v6e:4x4' or 'v4:2x2x2'")


def slice_topology(generation: Generation, chips: int) -> tuple[int, ...]:
    """Cloud TPU's shape for a slice of `chips` chips: from 2x2(x1), double the last of
    the smallest axes until it holds them (v4-256 = 128 chips = 4x4x8; v6e-128 = 8x16)."""
    if chips == 1:
        return (1, 1)
    shape = [2, 2] if generation.dims == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        shape[max(i for i, size in enumerate(shape) if size == min(shape))] *= 2
    return tuple(shape)


def parse_target(name: str) -> Target:
    """A slice name, a raw topology, or N of either across the DCN (`2xv6e-8`, `v6e-8x2`)."""
    slices, one = split_slices(name.strip().lower())
    target = dataclasses.replace(parse_slice(one), name=name, slices=slices)
    return dataclasses.replace(target, generation=dataclasses.replace(
        target.generation, host_chips=math.prod(target.chips_per_host)))


def split_slices(name: str) -> tuple[int, str]:
    """(slices, one slice's name) of `2xv6e-8` / `v6e-8x2`; (1, name) otherwise."""
    found = re.fullmatch(r"(\d+)x(v.+)", name) or re.fullmatch(r"(v\d+[a-z]?-\d+)x(\d+)", name)
    if found is None:
        return 1, name
    count, one = found.groups() if found.group(1).isdigit() else found.groups()[::-1]
    if int(count) < 1:
        raise _bad_target(name, "the number of slices must be at least 1")
    return int(count), one


def parse_slice(name: str) -> Target:
    match = re.fullmatch(r"(v\d+[a-z]?)([-:])(.+)", name)
    if not match or match.group(1) not in GENERATIONS:
        raise _bad_target(name, "unknown TPU generation")
    generation, kind, rest = GENERATIONS[match.group(1)], match.group(2), match.group(3)
    if kind == ":":
        return Target(name, generation, _raw_topology(name, generation, rest))
    if not rest.isdigit() or int(rest) not in generation.sizes:
        raise _bad_target(name, f"{generation.name} slices are {generation.name}-"
                                f"{{{','.join(map(str, generation.sizes))}}}")
    chips = int(rest) // (2 if generation.megacore else 1)
    return Target(name, generation, slice_topology(generation, chips))


def with_chip(target: Target, overrides: str) -> Target:
    """`target` with chip figures replaced (`--chip peak_tflops=900,hbm_gbps=1600`); a collective
    latency may be 0 (the projection without it)."""
    changes = {}
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        name, _, value = item.partition("=")
        if name not in CHIP_FIELDS or not _positive(value, allow_zero=name.endswith("latency_us")):
            raise UserError(f"--chip {item!r}: give name=value with a value > 0, names: {', '.join(CHIP_FIELDS)} "
                            "(collective_latency_us and dcn_latency_us may be 0)")
        changes[name] = float(value)
    if "usable_hbm_gib" in changes:
        changes["usable_source"] = "--chip"
    if "collective_latency_us" in changes:
        changes["latency_source"] = "--chip"
    if "dcn_host_gbps" in changes:
        changes["dcn_source"] = "--chip"
    if "dcn_latency_us" in changes:
        changes["dcn_latency_source"] = "--chip"
    return dataclasses.replace(target, generation=dataclasses.replace(target.generation, **changes))


def _positive(text: str, allow_zero: bool = False) -> bool:
    try:
        return float(text) > 0 or (allow_zero and float(text) == 0)
    except ValueError:
        return False


def _raw_topology(name: str, generation: Generation, text: str) -> tuple[int, ...]:
    parts = text.split("x")
    if len(parts) != generation.dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise _bad_target(name, f"a {generation.name} topology has {generation.dims} positive sizes")
    return tuple(int(p) for p in parts)


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"--target needs the TPU compiler (libtpu), which is not installed; {INSTALL_HINT}")


def target_devices(target: Target) -> list[Any]:
    """The compile-only devices of the target slice (process_index = the host)."""
    require_libtpu()
    # Compile-only: no chip is opened, so a second process (another plan, a TPU job on
    # this host) must not be refused by libtpu's one-process-per-host lock; and what
    # libtpu would otherwise ask a Cloud TPU VM's metadata server (warning when there is
    # none) is the target itself.
    libtpu_environment = unset(ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1",
                               TPU_ACCELERATOR_TYPE=target.accelerator_type, TPU_WORKER_HOSTNAMES="localhost")
    from jax.experimental import topologies

    options: dict[str, Any] = {"chips_per_host_bounds": target.chips_per_host}
    if target.slices > 1:
        options["num_slices"] = target.slices
    if target.generation.megacore:
        options["chip_config_name"] = "megacore"
    try:
        with environment(**libtpu_environment):
            return list(topologies.get_topology_desc(target.topology_name, platform="tpu", **options).devices)
    except Exception as exc:  # libtpu reports a bad topology as a runtime error
        raise _bad_target(target.name, f"libtpu rejected topology {target.topology_name} "
                                       f"({' '.join(str(exc).split())[:200]})") from None


def describe(target: Target, devices: list[Any]) -> str:
    hosts = len({d.process_index for d in devices})
    slices = f"{target.slices} slices of " if target.slices > 1 else ""
    return (f"{target.name} ({devices[0].device_kind}, {slices}topology {target.topology_name}): {len(devices)} "
            f"devices on {hosts} host(s)" + (", megacore" if target.generation.megacore else ""))
