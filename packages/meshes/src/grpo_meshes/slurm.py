"""Process id, count and coordinator of a run started by Slurm's `srun`.

Read from Slurm's variables here rather than left to JAX's own Slurm detection, because
that one reads SLURM_STEP_NODELIST only (a batch script's job list is SLURM_JOB_NODELIST),
keeps only the text before a bracket's first range (`n[01-02]-ib` gives `n01`, not
`n01-ib`), and picks a port from the job id; here the port is fixed and documented.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from grpo_meshes.errors import MeshError

# Port of the coordinator on the first host; GRPO_COORDINATOR_PORT overrides it.
SLURM_COORDINATOR_PORT = 8476
PORT_VARIABLE = "GRPO_COORDINATOR_PORT"
_BRACKET = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class SlurmProcess:
    process_id: int
    num_processes: int
    coordinator_address: str


def slurm_process(environ: Mapping[str, str]) -> Optional[SlurmProcess]:
    """This task's place in a multi-task Slurm step, or None outside one (or with one task)."""
    count, process_id = environ.get("SLURM_NTASKS", ""), environ.get("SLURM_PROCID", "")
    if not (count.isdigit() and int(count) > 1 and process_id.isdigit()):
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise MeshError(f"SLURM_NTASKS={count} but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set; "
                        "start the run with srun inside the allocation, or set mesh.coordinator_address")
    return SlurmProcess(int(process_id), int(count), f"{expand_nodelist(nodelist)[0]}:{coordinator_port(environ)}")


def coordinator_port(environ: Mapping[str, str]) -> int:
    text = environ.get(PORT_VARIABLE, str(SLURM_COORDINATOR_PORT))
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise MeshError(f"{PORT_VARIABLE}={text!r} is not a TCP port; use 1-65535 "
                        f"(default {SLURM_COORDINATOR_PORT})")
    return int(text)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list in order: `n[01-03,07],gpu-a[1-2]-ib` gives n01, n02, n03,
    n07, gpu-a1-ib, gpu-a2-ib (zero padding kept, several brackets in one name multiply)."""
    return [host for name in _split_top_level(nodelist) for host in _expand_name(name)]


def _split_top_level(nodelist: str) -> list[str]:
    names, depth, current = [], 0, ""
    for char in nodelist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    if depth != 0 or not all([*names, current]):
        raise MeshError(f"cannot read the Slurm node list {nodelist!r}; expected names like node[01-04,07],other")
    return [*names, current]


def _expand_name(name: str) -> list[str]:
    match = _BRACKET.search(name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end():]
    return [head + index + rest for index in _expand_ranges(match.group(1), name) for rest in _expand_name(tail)]


def _expand_ranges(ranges: str, name: str) -> list[str]:
    indices = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and (not high.isdigit() or int(high) < int(low))):
            raise MeshError(f"cannot read the range {part!r} of the Slurm node name {name!r}; "
                            "expected ranges like [01-04,07]")
        width = len(low)
        indices += [str(i).zfill(width) for i in range(int(low), int(high or low) + 1)]
    return indices
