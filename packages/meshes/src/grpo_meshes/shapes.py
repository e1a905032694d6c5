"""Mesh axis names and the parsing/resolution of "dp,fsdp,tp" shapes."""

from __future__ import annotations

import math

from grpo_meshes.errors import MeshError

AXES = ("dp", "fsdp", "tp")
MeshShape = tuple[int, int, int]


def looks_like_shape(text: str) -> bool:
    """True for strategy values such as "1,-1,2" (comma separated integers)."""
    parts = [p.strip() for p in text.split(",")]
    return len(parts) > 1 and all(p.lstrip("-").isdigit() for p in parts)


def parse_shape(text: str) -> MeshShape:
    """Parse "dp,fsdp,tp": three integers >= 1, at most one of them -1."""
    parts = [p.strip() for p in str(text).split(",")]
    example = "use three integers 'dp,fsdp,tp' such as '1,-1,1' or '2,-1,4'"
    if len(parts) != 3:
        raise MeshError(f"mesh shape {text!r} has {len(parts)} entries, expected 3 (dp, fsdp, tp); {example}")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise MeshError(f"mesh shape {text!r} is not made of integers; {example}") from None
    bad = [f"{axis}={size}" for axis, size in zip(AXES, shape) if size == 0 or size < -1]
    if bad:
        raise MeshError(f"mesh shape {text!r} has invalid sizes {', '.join(bad)}; sizes are >= 1, or -1 "
                        f"for 'all remaining devices'; {example}")
    if shape.count(-1) > 1:
        raise MeshError(f"mesh shape {text!r} has {shape.count(-1)} entries of -1; at most one axis can take "
                        f"the remaining devices, fix the others to numbers")
    return shape  # type: ignore[return-value]


def format_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(s) for s in shape)


def resolve_shape(shape: tuple[int, ...], device_count: int) -> MeshShape:
    """Replace the -1 entry so that the product equals `device_count`."""
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if device_count % known:
            raise MeshError(
                f"mesh shape {format_shape(shape)} cannot fill {device_count} devices: the fixed axes "
                f"multiply to {known}, which does not divide {device_count}; "
                f"{_shape_fix_hint(shape, device_count)}")
        shape = tuple(device_count // known if s == -1 else s for s in shape)
    check_shape_matches_devices(shape, device_count)
    return shape  # type: ignore[return-value]


def check_shape_matches_devices(shape: tuple[int, ...], device_count: int) -> None:
    """Raise unless dp*fsdp*tp equals the number of devices."""
    product = math.prod(shape)
    if product != device_count:
        raise MeshError(
            f"mesh shape {format_shape(shape)} (dp*fsdp*tp = {product}) does not match the "
            f"{device_count} devices; {_shape_fix_hint(shape, device_count)}")


def _shape_fix_hint(shape: tuple[int, ...], device_count: int) -> str:
    dp, _, tp = (max(s, 1) for s in shape)
    options = [f"'1,-1,{t}'" for t in (1, 2, 4, 8) if device_count % t == 0 and t <= device_count]
    if device_count % (dp * tp) == 0:
        options.insert(0, f"'{dp},-1,{tp}'")
    return f"the product must equal {device_count}; try {' or '.join(dict.fromkeys(options))}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
