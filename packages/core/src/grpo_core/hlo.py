"""Figures read off a compiled XLA module's HLO text (`compiled.as_text()`).

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip
count, so for blocked losses, micro-batch scans and decode loops it is off by the
trip counts. `HloModule` walks the computations instead:

- `matmul_flops()`: 2 * prod(output dims) * prod(contracted dims) of every `dot`,
  each loop body multiplied by its trip count (XLA's `known_trip_count`
  annotation; loops without one are counted once and listed in
  `unknown_trip_counts`). Elementwise work is not counted: with a vocabulary
  of 151,936 the matmuls are all but all of it.
- `collective_bytes(computation)`: bytes produced by collectives (all-gather,
  all-reduce, reduce-scatter, all-to-all, collective-permute) in one execution of
  a computation, e.g. one iteration of a decode loop body.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{$")
_CALLEES = re.compile(r"(?:calls|body|to_apply|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass
class Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str

    def callees(self) -> list[str]:
        names = _CALLEES.findall(self.attrs)
        for group in _BRANCHES.findall(self.attrs):
            names += [n.strip().lstrip("%") for n in group.split(",")]
        return names

    def body(self) -> str | None:
        """The body computation of a while instruction."""
        found = re.search(r"body=%([\w.\-]+)", self.attrs)
        return found.group(1) if found else None

    def trip_count(self) -> int | None:
        found = _TRIP_COUNT.search(self.attrs)
        return int(found.group(1)) if found else None


@dataclass
class Computation:
    name: str
    shapes: dict[str, str] = field(default_factory=dict)  # parameter and instruction name -> shape
    instructions: list[Instruction] = field(default_factory=list)


def array_dims(shape: str) -> list[list[int]]:
    """Dims of every array in a shape string ('f32[8,16]{1,0}' or a tuple of them)."""
    return [[int(d) for d in dims.split(",") if d] for _, dims in _ARRAY.findall(shape)]


def shape_bytes(shape: str) -> int:
    return sum(_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(shape))


def _closing(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    body = line.strip().removeprefix("ROOT ")
    if not body.startswith("%") or " = " not in body:
        return None
    name, rest = body[1:].split(" = ", 1)
    shape_end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
    if "(" not in rest:
        return None
    op = rest[: rest.index("(")]
    args_end = _closing(rest, len(op))
    operands = re.findall(r"%([\w.\-]+)", rest[len(op):args_end])
    return Instruction(name, shape, op, operands, rest[args_end:])


class HloModule:
    """The computations of one compiled module's HLO text."""

    def __init__(self, text: str):
        self.computations: dict[str, Computation] = {}
        self.entry = ""
        current = None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group(2))
                self.computations[current.name] = current
                self.entry = current.name if header.group(1) else self.entry
                for param in re.finditer(r"([\w.\-]+): ([^,()]+(?:\([^)]*\))?)", header.group(3)):
                    current.shapes[param.group(1)] = param.group(2)
                continue
            instruction = parse_instruction(line) if current else None
            if instruction:
                current.shapes[instruction.name] = instruction.shape
                current.instructions.append(instruction)
        self.unknown_trip_counts: list[str] = []

    def while_loops(self, computation: str | None = None) -> list[Instruction]:
        """The while instructions directly in `computation` (default: the entry)."""
        return [i for i in self.computations[computation or self.entry].instructions if i.op == "while"]

    def matmul_flops(self, computation: str | None = None) -> float:
        """Matmul FLOPs of one execution of `computation` (default: the entry), loops included."""
        comp = self.computations[computation or self.entry]
        total = 0.0
        for inst in comp.instructions:
            if inst.op == "dot":
                total += _dot_flops(inst, comp)
            repeat = 1
            if inst.op == "while":
                repeat = inst.trip_count() or 1
                if inst.trip_count() is None:
                    self.unknown_trip_counts.append(inst.name)
            total += repeat * sum(self.matmul_flops(c) for c in inst.callees() if c in self.computations)
        return total

    def collective_bytes(self, computation: str | None = None, ops: tuple[str, ...] = COLLECTIVES) -> dict[str, int]:
        """Bytes produced per collective kind in one execution of `computation`
        (nested loops multiplied by their trip counts; async pairs counted once)."""
        comp = self.computations[computation or self.entry]
        totals: dict[str, int] = {}
        for inst in comp.instructions:
            kind = inst.op.removesuffix("-done")
            if kind in ops and not inst.op.endswith("-start"):
                totals[kind] = totals.get(kind, 0) + shape_bytes(inst.shape)
            if inst.op.startswith("async-") and inst.op != "async-start":
                continue  # async-update/done wrap the same computation as their start
            repeat = (inst.trip_count() or 1) if inst.op == "while" else 1
            for callee in inst.callees():
                for kind, value in self.collective_bytes(callee, ops).items() if callee in self.computations else ():
                    totals[kind] = totals.get(kind, 0) + repeat * value
        return totals


def _dot_flops(inst: Instruction, comp: Computation) -> float:
    lhs = array_dims(comp.shapes.get(inst.operands[0], ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    if not lhs or contracting is None:
        return 0.0
    contracted = math.prod(lhs[0][int(d)] for d in contracting.group(1).split(",") if d)
    return 2.0 * math.prod(array_dims(inst.shape)[0]) * contracted
