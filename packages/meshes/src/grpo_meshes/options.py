"""Options dataclasses of the built-in mesh strategies (`mesh.options:`)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_meshes.errors import MeshError
from grpo_meshes.shapes import parse_shape


@dataclass(frozen=True)
class AutoOptions:
    """`auto` takes no options; it is full-device FSDP (shape 1,-1,1)."""


@dataclass(frozen=True)
class FullFsdpOptions:
    """`full_fsdp` takes no options: dp=1, fsdp=all devices, tp=1."""


@dataclass(frozen=True)
class HostLocalOptions:
    """`host_local` takes no options: dp=processes, fsdp=devices per process, tp=1."""


@dataclass(frozen=True)
class ExplicitOptions:
    """`explicit`: a "dp,fsdp,tp" shape with at most one -1.

    fsdp_within_host: order devices process by process (dp across hosts) and
    warn when the shape still puts an fsdp group on several hosts.
    """

    shape: str = "1,-1,1"
    fsdp_within_host: bool = False

    def __post_init__(self) -> None:
        parse_shape(self.shape)


@dataclass(frozen=True)
class FsdpTpOptions:
    """`fsdp_tp`: tensor parallelism of `tp` devices, FSDP over the rest (1,-1,tp)."""

    tp: int
    fsdp_within_host: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise MeshError(f"mesh.options.tp must be an integer >= 1, got {self.tp!r}; "
                            f"pick a divisor of the attention heads such as 2, 4 or 8")
