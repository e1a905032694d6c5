"""The device groups of a compiled module's collectives (their `replica_groups` in the HLO text), and
whether a collective spans devices of different labels (e.g. slices joined by the data-center network)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from grpo_core.hlo import Instruction


_GROUPS = re.compile(r"replica_groups=(\{[\d,{} ]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_PAIRS = re.compile(r"source_target_pairs=(\{[\d,{} ]*\})")


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")


def replica_groups(inst: Instruction, partitions: int) -> list[list[int]]:
    """The device groups (partition ids) a collective runs over: its replica_groups, listed
    ({{0,1},{2,3}}), as an iota ([2,2]<=[4], [2,2]<=[2,2]T(1,0)) or over the axes of a device mesh
    (mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}); a collective-permute's
    source-target pairs; one group of all `partitions` when none are given or the form is not one
    of these."""
    over_mesh = _MESH_GROUPS.search(inst.attrs)
    if over_mesh:
        return _mesh_groups(*over_mesh.groups(), partitions)
    pairs = _PAIRS.search(inst.attrs)
    found = pairs or _GROUPS.search(inst.attrs)
    text = found.group(1) if found else "{}"
    if text.startswith("["):
        return _iota_groups(text)
    groups = [[int(i) for i in group.split(",") if i.strip()] for group in re.findall(r"\{([\d, ]*)\}", text[1:-1])]
    return [g for g in groups if g] or [list(range(partitions))]


def _iota_groups(text: str) -> list[list[int]]:
    """[G,S]<=[dims]T(perm): iota over dims, transposed by perm, reshaped to G groups of S."""
    shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
    split = lambda part: [int(v) for v in part.split(",")]  # noqa: E731
    ids = np.arange(math.prod(split(dims))).reshape(split(dims))
    if perm:
        ids = ids.transpose(split(perm))
    return ids.reshape(split(shape)).tolist()


def _mesh_groups(axes_text: str, ids_text: str | None, grouped_text: str, partitions: int) -> list[list[int]]:
    """Groups of the devices that differ only along the `grouped` axes of a mesh whose positions hold
    `ids` (row-major; iota when not given)."""
    axes = re.findall(r"'([^']+)'=(\d+)", axes_text)
    grouped = re.findall(r"'([^']+)'", grouped_text)
    names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
    if "(" in grouped_text or not set(grouped) <= set(names) or math.prod(sizes) != partitions:
        return [list(range(partitions))]  # sub-axes or a form not read here: taken as one group of all
    ids = _iota_ids(ids_text, partitions).reshape(sizes)
    inner = [names.index(name) for name in grouped]
    outer = [axis for axis in range(len(sizes)) if axis not in inner]
    moved = np.transpose(ids, outer + inner)
    return moved.reshape(-1, math.prod(sizes[axis] for axis in inner)).tolist()


def _iota_ids(text: str | None, partitions: int) -> np.ndarray:
    """Device ids of `[dims]T(perm)` (iota over dims, transposed), a listed `0,4,1,5`, or iota."""
    found = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", (text or "").strip())
    if found:
        dims, perm = ([int(v) for v in part.split(",")] if part else None for part in found.groups())
        ids = np.arange(partitions).reshape(dims)
        return (ids.transpose(perm) if perm else ids).reshape(-1)
    listed = [int(v) for v in (text or "").split(",") if v.strip()]
    return np.asarray(listed) if len(listed) == partitions else np.arange(partitions)


def crosses_groups(label_of_partition: Sequence[int]) -> Callable[[Instruction], bool]:
    """A `where` for collective_bytes/collective_count: whether a collective's groups hold
    partitions of different labels (e.g. the slice of each device of the mesh, in partition order)."""
    def crosses(inst: Instruction) -> bool:
        return any(len({label_of_partition[p] for p in group}) > 1
                   for group in replica_groups(inst, len(label_of_partition)))
    return crosses
