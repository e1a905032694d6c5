"""Figures read off a compiled XLA module's HLO text (`compiled.as_text()`).

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip
count, so for blocked losses, micro-batch scans and decode loops it is off by the
trip counts. `HloModule` walks the computations instead:

- `matmul_flops()`: 2 * prod(output dims) * prod(contracted dims) of every `dot`
  (and of every `convolution`, which is how the TPU compiler writes a dot: output
  batch x output features x input features x the window taps that land on input),
  each loop body multiplied by its trip count (XLA's `known_trip_count`
  annotation, or N of a condition that is only `counter < N`, as the TPU
  compiler leaves scans; loops without either are counted once and listed in
  `unknown_trip_counts`). Elementwise work is not counted: with a vocabulary
  of 151,936 the matmuls are all but all of it.
- `collective_bytes(computation)`: bytes produced by collectives (all-gather,
  all-reduce, reduce-scatter, all-to-all, collective-permute) in one execution of
  a computation, e.g. one iteration of a decode loop body; `collective_count`: how
  many of them it issues (each pays a latency, whatever its size). `where=` selects
  some of them, e.g. those whose replica groups span slices (grpo_core.replica_groups).
- `dcn_transfers(computation)`: what a TPU multislice program sends between slices.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

_BITS = re.compile(r"[a-z]+(\d+)")  # an element type's width: bf16 16, f8e4m3fn 8, s4 4, c64 64
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{$")
_CALLEES = re.compile(r"(?:calls|body|to_apply|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COUNTER_OPS = {"parameter", "constant", "get-tuple-element", "compare"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass
class Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    literal: str = ""  # a constant's value

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
    root: str = ""  # the ROOT instruction's name

    def instruction(self, name: str) -> Instruction | None:
        return next((i for i in self.instructions if i.name == name), None)


def array_dims(shape: str) -> list[list[int]]:
    """Dims of every array in a shape string ('f32[8,16]{1,0}' or a tuple of them)."""
    return [[int(d) for d in dims.split(",") if d] for _, dims in _ARRAY.findall(shape)]


def element_bytes(dtype: str) -> float:
    """Bytes of one element of an HLO element type: its bit width (the number after its kind, so every
    float8 variant is 1 and s4 half a byte) / 8; pred 1; a type without a width 4."""
    if dtype == "pred":
        return 1
    width = _BITS.match(dtype)
    return int(width.group(1)) / 8 if width else 4


def shape_bytes(shape: str) -> int:
    return math.ceil(sum(element_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
                         for dtype, dims in _ARRAY.findall(shape)))


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
    literal = rest[len(op) + 1:args_end - 1] if op == "constant" else ""
    return Instruction(name, shape, op, operands, rest[args_end:], literal)


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
                current.root = instruction.name if line.lstrip().startswith("ROOT ") else current.root
        self.unknown_trip_counts: list[str] = []
        self.fusion_bodies = {callee for c in self.computations.values() for i in c.instructions if i.op == "fusion"
                              for callee in i.callees()}
        self._async_channels: set[str] | None = None

    def while_loops(self, computation: str | None = None) -> list[Instruction]:
        """The while instructions directly in `computation` (default: the entry)."""
        return [i for i in self.computations[computation or self.entry].instructions if i.op == "while"]

    def trip_count(self, loop: Instruction) -> int | None:
        """XLA's known_trip_count of a while loop, else ceil(N / k) when its condition is only
        `counter < N` and its body adds a constant k to the counter (a scan's counter starts at 0;
        the TPU compiler's collective matmul loops do two steps per iteration, k = 2); None for a
        loop that stops on its data."""
        if loop.trip_count() is not None:
            return loop.trip_count()
        found = re.search(r"condition=%([\w.\-]+)", loop.attrs)
        condition = self.computations.get(found.group(1)) if found else None
        if condition is None or not {i.op for i in condition.instructions} <= _COUNTER_OPS:
            return None
        compares = [i for i in condition.instructions if i.op == "compare" and "direction=LT" in i.attrs]
        constants = {i.name: i.literal for i in condition.instructions if i.op == "constant"}
        bound = constants.get(compares[0].operands[1], "") if len(compares) == 1 else ""
        counter = condition.instruction(compares[0].operands[0]) if bound.isdigit() else None
        step = self._counter_step(loop, _tuple_index(counter)) if counter else None
        return -(-int(bound) // step) if step else None

    def _counter_step(self, loop: Instruction, index: int | None) -> int | None:
        """k when the loop body's result sets tuple element `index` to that element plus constant k."""
        body = self.computations.get(loop.body() or "")
        root = body.instruction(body.root) if body else None
        if index is None or root is None or root.op != "tuple" or index >= len(root.operands):
            return None
        update = body.instruction(root.operands[index])
        if update is None or update.op != "add":
            return None
        operands = [_through_copies(body, name) for name in update.operands]
        reads = [i for i in operands if i and i.op == "get-tuple-element" and _tuple_index(i) == index]
        steps = [i.literal for i in operands if i and i.op == "constant"]
        return int(steps[0]) if reads and steps and steps[0].isdigit() and int(steps[0]) > 0 else None

    def matmul_flops(self, computation: str | None = None) -> float:
        """Matmul FLOPs of one execution of `computation` (default: the entry), loops included."""
        comp = self.computations[computation or self.entry]
        total = 0.0
        for inst in comp.instructions:
            if inst.op == "dot":
                total += _dot_flops(inst, comp)
            if inst.op == "convolution":
                total += _convolution_flops(inst, comp)
            repeat = 1
            if inst.op == "while":
                repeat = self.trip_count(inst) or 1
                if self.trip_count(inst) is None:
                    self.unknown_trip_counts.append(inst.name)
            total += repeat * sum(self.matmul_flops(c) for c in inst.callees() if c in self.computations)
        return total

    def collective_bytes(self, computation: str | None = None, ops: tuple[str, ...] = COLLECTIVES,
                         seen: set[str] | None = None, overlapped: bool | None = None,
                         where: Callable[[Instruction], bool] | None = None) -> dict[str, int]:
        """Bytes produced per collective kind in one execution of `computation`
        (nested loops multiplied by their trip counts; async pairs counted once, and so is
        a collective the TPU compiler copies into several fusions: one channel id, one transfer).
        `overlapped`: True counts only collectives issued asynchronously (they overlap compute),
        False only the others, None all; `where`: only the collectives it accepts (e.g. those
        whose groups cross slices, `crosses_groups`)."""
        return self._collectives(computation, ops, set() if seen is None else seen, overlapped, False,
                                 lambda inst: shape_bytes(inst.shape) if where is None or where(inst) else 0)

    def collective_count(self, computation: str | None = None, ops: tuple[str, ...] = COLLECTIVES,
                         overlapped: bool | None = None,
                         where: Callable[[Instruction], bool] | None = None) -> dict[str, int]:
        """Collectives issued per kind in one execution of `computation`, counted as
        `collective_bytes` counts their bytes: each one pays the interconnect's latency."""
        return self._collectives(computation, ops, set(), overlapped, False,
                                 lambda inst: int(where is None or where(inst)))

    def dcn_transfers(self, computation: str | None = None) -> tuple[int, int]:
        """(bytes, count) of the transfers between slices the TPU compiler writes for a multislice
        program (host-transfer `send`s to its megascale runtime, one per collective across slices,
        the slice's own SPMD program holding only the collectives within it), in one execution of
        `computation`, loops times their trip counts; bytes are what a device sends."""
        def sent(inst: Instruction) -> int:
            return _first_array_bytes(inst.shape) if _is_dcn_transfer(inst) else 0

        sizes = self._collectives(computation, ("send",), set(), None, False, sent)
        counts = self._collectives(computation, ("send",), set(), None, False, lambda i: int(_is_dcn_transfer(i)))
        return sum(sizes.values()), sum(counts.values())

    def _collectives(self, computation: str | None, ops: tuple[str, ...], seen: set[str], overlapped: bool | None,
                     in_async: bool, measure) -> dict[str, int]:
        comp = self.computations[computation or self.entry]
        in_async = in_async or _async_context(comp)
        totals: dict[str, int] = {}
        for inst in comp.instructions:
            kind = inst.op.removesuffix("-done")
            chosen = overlapped is None or overlapped == (in_async or self._asynchronous(inst))
            if kind in ops and not inst.op.endswith("-start") and chosen and _first_of_channel(inst, comp.name in self.fusion_bodies, seen):
                totals[kind] = totals.get(kind, 0) + measure(inst)
            if inst.op.startswith("async-") and inst.op != "async-start":
                continue  # async-update/done wrap the same computation as their start
            repeat = (self.trip_count(inst) or 1) if inst.op == "while" else 1
            for callee in (c for c in inst.callees() if c in self.computations):
                inner = self._collectives(callee, ops, seen, overlapped, in_async or inst.op == "async-start", measure)
                for kind, value in inner.items():
                    totals[kind] = totals.get(kind, 0) + repeat * value
        return totals

    def _asynchronous(self, inst: Instruction) -> bool:
        """Issued asynchronously: a -done op, or a collective whose channel has a copy in an async context."""
        if self._async_channels is None:
            self._async_channels = {_channel(i) for c in self.computations.values() if _async_context(c)
                                    for i in c.instructions} - {None}
        return inst.op.endswith("-done") or _channel(inst) in self._async_channels


def _is_dcn_transfer(inst: Instruction) -> bool:
    return inst.op == "send" and "_xla_megascale_transfer_type" in inst.attrs


def _first_array_bytes(shape: str) -> int:
    """Bytes of the first array of a shape (a send's data, not its context and token)."""
    found = _ARRAY.search(shape)
    return shape_bytes(found.group(0)) if found else 0


def _through_copies(comp: Computation, name: str) -> Instruction | None:
    """The instruction `name` copies (through copy and bitcast chains), or itself."""
    inst = comp.instruction(name)
    while inst is not None and inst.op in ("copy", "bitcast") and len(inst.operands) == 1:
        inst = comp.instruction(inst.operands[0])
    return inst


def _tuple_index(inst: Instruction) -> int | None:
    """The element a get-tuple-element reads."""
    found = re.search(r"\bindex=(\d+)", inst.attrs) if inst.op == "get-tuple-element" else None
    return int(found.group(1)) if found else None


def _async_context(comp: Computation) -> bool:
    """A computation the TPU compiler runs as part of an asynchronous collective (its start, done,
    or the compute fusions it is split across)."""
    return comp.name.startswith("async_collective_fusion") or any(
        i.op == "custom-call" and "AsyncCollective" in i.attrs for i in comp.instructions)


def _channel(inst: Instruction) -> str | None:
    found = re.search(r"channel_id=(\d+)", inst.attrs)
    return found.group(1) if found else None


def _first_of_channel(inst: Instruction, in_fusion: bool, seen: set[str]) -> bool:
    """Whether `inst` is a collective of its own, not a copy of one counted already: a copy is a
    channel id seen before, found again inside a fusion (the TPU compiler copies a collective into
    the fusions it overlaps). Outside fusions every collective runs, even sharing an id (the TPU
    compiler gives shard_map's psums one id, e.g. both of a layer loop's)."""
    channel = _channel(inst)
    if channel is None:
        return True
    first = channel not in seen
    seen.add(channel)
    return first or not in_fusion


def _dot_flops(inst: Instruction, comp: Computation) -> float:
    lhs = array_dims(comp.shapes.get(inst.operands[0], ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    if not lhs or contracting is None:
        return 0.0
    contracted = math.prod(lhs[0][int(d)] for d in contracting.group(1).split(",") if d)
    return 2.0 * math.prod(array_dims(inst.shape)[0]) * contracted


def _window(attrs: str, key: str, dims: int, default: int) -> list[int]:
    found = re.search(rf"\b{key}=([\dx]+)", attrs)
    return [int(v) for v in found.group(1).split("x")] if found else [default] * dims


def _valid_taps(out: int, taps: int, size: int, stride: int, low: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one spatial dimension that read an input element
    (not padding, not a hole of lhs dilation)."""
    position = np.arange(out)[:, None] * stride + np.arange(taps)[None, :] * rhs_dilate - low
    return int(np.count_nonzero((position >= 0) & (position <= (size - 1) * lhs_dilate) & (position % lhs_dilate == 0)))


def _convolution_flops(inst: Instruction, comp: Computation) -> float:
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs)
    lhs, rhs = (array_dims(comp.shapes.get(name, "")) for name in inst.operands[:2])
    out = array_dims(inst.shape)
    if not labels or not lhs or not rhs or not out:
        return 0.0
    lhs_of, rhs_of, out_of = (dict(zip(labels.group(i), dims[0])) for i, dims in ((1, lhs), (2, rhs), (3, out)))
    spatial = sorted((c for c in labels.group(3) if c.isdigit()), key=int)
    pads = re.search(r"pad=([\d_x-]+)", inst.attrs)
    lows = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * len(spatial)
    stride, lhs_dilate, rhs_dilate = (_window(inst.attrs, key, len(spatial), 1)
                                      for key in ("stride", "lhs_dilate", "rhs_dilate"))
    taps = math.prod(_valid_taps(out_of[d], rhs_of[d], lhs_of[d], stride[i], lows[i], lhs_dilate[i], rhs_dilate[i])
                     for i, d in enumerate(spatial))
    return 2.0 * out_of["b"] * out_of["f"] * rhs_of["i"] * taps

