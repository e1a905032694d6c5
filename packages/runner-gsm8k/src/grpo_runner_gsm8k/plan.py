"""`grpo-run --plan`: per-device memory of a run, before any weight is loaded.

The rollout (prefill + decode) and the train step are compiled ahead of time at the
configured shapes, with abstract inputs only (shapes, dtypes and shardings; no weights,
no data), and the compiler's buffer assignment is read back. Without --target they
compile for this host's devices (on a CPU host: XLA:CPU's figures); with --target
they compile for a TPU slice with the TPU compiler (see tpu_target):

    grpo-run --config X.yaml --plan [--capacity-gib 31.25]
    grpo-run --config X.yaml --plan --target v6e-8 [--sweep micro_batch_size_per_device]

Exit codes: 0 fits, 2 bad input, 3 does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import RunConfig
from grpo_core.contracts import SamplingParams
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig
from grpo_core.models.checkpoint import abstract_model
from grpo_core.models.config import HUB_ARCHITECTURES, hub_architecture
from grpo_core.models.precision import needs_cast
from grpo_core.models.qwen import resolve_dtype
from grpo_core.registry import Registry
from grpo_core.rollout_records import trimmed_widths
from grpo_core.sharding import param_shardings
from grpo_meshes import (TRAIN_BATCH_AXES, batch_shard_count, build_mesh_from_config, rollout_batch_sharding,
                         setup_processes, train_batch_sharding)
from grpo_rollout.backend import JaxRollout, abstract_outputs
from grpo_rollout.collectives import decode_collective_bytes_per_token
from grpo_rollout.decode import decode, prefill
from grpo_rollout.gather import GATHER_HEADROOM, has_sharded_weights
from grpo_rollout.prompts import bucket_length

from grpo_runner_gsm8k.build import attention_impl, build_tokenizer, micro_batches, model_config, preflight, rows_per_step
from grpo_runner_gsm8k.optim import moment_dtype
from grpo_runner_gsm8k.program import RunProgram, build_program
from grpo_runner_gsm8k.step import UpdateBatch
from grpo_runner_gsm8k.tpu_target import HBM_SOURCE, Target, describe, parse_target, target_devices

EXIT_DOES_NOT_FIT = 3
SWEEP_FIELDS = ("micro_batch_size_per_device",)
GIB = float(1 << 30)


# ---- what is measured ------------------------------------------------------------
@dataclass(frozen=True)
class PhaseMemory:
    """Per-device bytes of one compiled phase.

    `aliased` outputs reuse donated argument buffers; `other` is state alive on the
    device during the phase that is not one of its arguments (the optimizer state and
    the float32 masters during the rollout, which runs on their compute-dtype copy;
    the reference params when loss.beta > 0).
    """

    name: str
    arguments: int
    outputs: int
    aliased: int
    temp: int
    other: int = 0
    refused: bool = False  # the compiler refused it for HBM; temp is the size it reported
    note: str = ""  # printed under the table

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temp + self.other

    @classmethod
    def from_compiled(cls, name: str, compiled: Any, other: int = 0) -> "PhaseMemory":
        stats = compiled.memory_analysis()
        return cls(name, stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                   stats.temp_size_in_bytes, other)


# The TPU compiler refuses a program whose buffers exceed the chip's HBM, giving the size.
_HBM_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED:.*?required for HLO temporaries \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def compile_phase(name: str, lower: Callable[..., Any], args: tuple, other: int = 0) -> tuple[PhaseMemory, Any]:
    """(memory, compiled) of `lower(*args).compile()`; when the compiler refuses it for
    HBM, the memory it reported needing (temporaries) beside the arguments, and None."""
    try:
        compiled = lower(*args).compile()
    except jax.errors.JaxRuntimeError as exc:
        if "Mosaic" in str(exc):
            first = " ".join(str(exc).strip().splitlines()[0].split())[:300]
            raise UserError(f"{name}: the TPU compiler rejected a Pallas kernel ({first}); with loss.impl: pallas "
                            "change loss.options.block_size / time_block") from None
        match = _HBM_EXHAUSTED.search(str(exc))
        if not match:
            raise
        temp = int(float(match.group(1)) * _UNITS[match.group(2)])
        return PhaseMemory(name, per_device_bytes(args), 0, 0, temp, other, refused=True), None
    return PhaseMemory.from_compiled(name, compiled, other), compiled


@dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str  # where the number comes from, printed next to it

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class PlanInputs:
    """Everything the compiles share: the mesh, the abstract model and optimizer state."""

    cfg: RunConfig
    mesh: Mesh
    qcfg: QwenConfig
    program: RunProgram  # the run's own jitted functions and plugins
    params: Any  # abstract: ShapeDtypeStruct leaves with their NamedShardings
    opt_state: Any
    target: Optional[str] = None  # the TPU slice, described, when planning for one

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self.program.graphdef

    @property
    def rollout(self) -> JaxRollout:
        return self.program.rollout

    @property
    def params_bytes(self) -> int:
        return per_device_bytes(self.params)

    @property
    def forward_params(self) -> Any:
        """The params as rollout and scoring take them: in the compute dtype (see loop.Trainer.forward_params)."""
        return abstract_cast(self.params, resolve_dtype(self.cfg.model.dtype))

    @property
    def masters_beside_rollout(self) -> int:
        """The stored params stay alive beside their compute-dtype copy when the dtypes differ."""
        return self.params_bytes if needs_cast(self.params, resolve_dtype(self.cfg.model.dtype)) else 0

    @property
    def held_beside_rollout(self) -> int:
        """Device state alive during rollout and scoring that is not their argument."""
        return per_device_bytes(self.opt_state) + self.masters_beside_rollout + self.reference_bytes

    @property
    def reference_bytes(self) -> int:
        """A frozen copy of the params (in the compute dtype) lives on the devices when the KL term is on."""
        return per_device_bytes(self.forward_params) if self.cfg.loss.beta > 0 else 0


# ---- abstract inputs ------------------------------------------------------------
def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree) if hasattr(leaf, "sharding"))


def abstract_array(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def abstract_cast(tree: Any, dtype: Any) -> Any:
    """grpo_core.models.precision.compute_params of abstract params: floating leaves in `dtype`."""
    return jax.tree.map(lambda x: abstract_array(
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, x.sharding), tree)


def abstract_run_model(cfg: RunConfig, qcfg: QwenConfig, mesh: Mesh, strategy: Any) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, abstract params) of the sharded model, built by shape evaluation only
    and sharded as build.build_model shards the real one."""
    model = abstract_model(qcfg, cfg.model.param_dtype, cfg.model.remat, cfg.model.scan_layers)
    model.set_activation_sharding(mesh, strategy.activation_rules)
    model.set_attention(attention_impl(cfg, mesh))
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh, strategy.param_rules)
    return graphdef, jax.tree.map(lambda leaf, sharding: abstract_array(leaf.shape, leaf.dtype, sharding),
                                  state, shardings)


def abstract_opt_state(optimizer: Any, params: Any, mesh: Mesh) -> Any:
    """The optimizer state as the run holds it: param-shaped leaves (moments) sharded like
    their params (eager `optimizer.init` keeps the params' shardings), the rest (step
    counts) replicated."""
    shapes = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer, lambda leaf, param: abstract_array(leaf.shape, leaf.dtype, param.sharding), shapes, params,
        transform_non_params=lambda leaf: abstract_array(leaf.shape, leaf.dtype, replicated(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def abstract_key(mesh: Mesh) -> jax.ShapeDtypeStruct:
    key = jax.eval_shape(lambda: jax.random.key(0))
    return abstract_array(key.shape, key.dtype, replicated(mesh))


# ---- the model's architecture without the Hub --------------------------------------
def plan_architecture(cfg: RunConfig) -> QwenConfig:
    """A local model dir or the built-in table for `model.path`, the config's
    `model.architecture` (sized to the tokenizer) otherwise."""
    path = cfg.model.path
    if path is None:
        return model_config(cfg, build_tokenizer(cfg))
    if os.path.isdir(path):
        return model_config(cfg, None)
    known = hub_architecture(path)
    if known is None:
        raise UserError(f"model.path {path!r} is not a local directory and its architecture is not built in "
                        f"(known: {', '.join(HUB_ARCHITECTURES)}); download the model's config.json into a "
                        "directory and point model.path at it")
    return known


def check_plannable_rollout(cfg: RunConfig, backend: Any) -> None:
    if not isinstance(backend, JaxRollout):
        raise UserError(f"rollout.backend {cfg.rollout.backend!r}: the memory plan compiles the 'jax' backend's "
                        "prefill and decode only; plan with rollout.backend=jax")


def build_plan_inputs(cfg: RunConfig, registry: Registry, target: Optional[Target] = None) -> PlanInputs:
    """The plan's inputs on this host's devices, or on the compile-only devices of a TPU
    `target` (every host of the slice, planned from this one process)."""
    devices = target_devices(target) if target else None
    if devices is None:
        setup_processes(cfg.mesh)
    resolved = build_mesh_from_config(cfg.mesh, registry.mesh, devices)
    qcfg = plan_architecture(cfg)
    preflight(cfg, resolved.mesh, qcfg, devices)
    graphdef, params = abstract_run_model(cfg, qcfg, resolved.mesh, resolved.strategy)
    # stop ids change no buffer: the plan needs no tokenizer for them
    program = build_program(cfg, registry, resolved.mesh, graphdef, SamplingParams.from_config(cfg.rollout))
    check_plannable_rollout(cfg, program.rollout)
    return PlanInputs(
        cfg=cfg, mesh=resolved.mesh, qcfg=qcfg, program=program, params=params,
        opt_state=abstract_opt_state(program.optimizer, params, resolved.mesh),
        target=describe(target, devices) if target else None)


# ---- shapes ----------------------------------------------------------------------------
def prompt_bucket(inputs: PlanInputs) -> int:
    """Widest prompt batch: rollout.max_prompt_length rounded up to the backend's bucket."""
    try:
        return bucket_length(inputs.cfg.rollout.max_prompt_length, inputs.rollout.options.prompt_buckets)
    except ValueError as exc:
        raise UserError(f"rollout.max_prompt_length: {exc}") from None


def train_widths(inputs: PlanInputs) -> tuple[int, int]:
    """(prompt, completion) columns of the widest trimmed training batch."""
    r = inputs.cfg.rollout
    return trimmed_widths(r.max_prompt_length, r.max_new_tokens, prompt_bucket(inputs), r.max_new_tokens,
                          inputs.rollout.options.trim_bucket)


def abstract_update_batch(inputs: PlanInputs) -> UpdateBatch:
    """The widest UpdateBatch of a step, as the loop builds it (see loop.Trainer.update_batch)."""
    cfg, mesh = inputs.cfg, inputs.mesh
    rows, (prompt_w, completion_w) = rows_per_step(cfg), train_widths(inputs)
    tokens = lambda dtype, width: abstract_array((rows, width), dtype, train_batch_sharding(mesh))  # noqa: E731
    return UpdateBatch(
        input_ids=tokens(jnp.int32, prompt_w + completion_w), attention_mask=tokens(jnp.int32, prompt_w + completion_w),
        targets=tokens(jnp.int32, completion_w), loss_mask=tokens(jnp.float32, completion_w),
        advantages=abstract_array((rows,), jnp.float32, train_batch_sharding(mesh, ndim=1)),
        old_logp=tokens(jnp.float32, completion_w) if inputs.program.has_old_logps else None,
        ref_logp=tokens(jnp.float32, completion_w) if inputs.program.scores_ref_logps else None,
        sampler_logp=tokens(jnp.float32, completion_w) if inputs.program.carries_sampler_logps else None,
        prompt_width=prompt_w)


def with_micro_batch_size(cfg: RunConfig, size: int) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size_per_device=size))


# ---- compiles ----------------------------------------------------------------------------
def _rollout_inputs(inputs: PlanInputs) -> tuple[dict, Any, Any]:
    """(static args, abstract prompts, abstract key) of one rollout batch (rows = prompts_per_step * n)."""
    cfg, mesh = inputs.cfg, inputs.mesh
    batch_sharding = rollout_batch_sharding(mesh, cfg.rollout.sharding)
    prompts = abstract_array((rows_per_step(cfg), prompt_bucket(inputs)), jnp.int32, batch_sharding)
    static = inputs.rollout.static_args(inputs.graphdef, inputs.forward_params, inputs.program.sampling, 0,
                                        batch_sharding)
    return static, prompts, abstract_key(mesh)


def compile_rollout(inputs: PlanInputs) -> tuple[Any, Any]:
    """(prefill, decode) compiled for one rollout batch."""
    static, prompts, key = _rollout_inputs(inputs)
    prefill_compiled = prefill.lower(inputs.forward_params, prompts, prompts, key, **static).compile()
    cache, state = abstract_outputs(prefill_compiled)
    return prefill_compiled, decode.lower(inputs.forward_params, cache, state, key, **static).compile()


def rollout_phases(inputs: PlanInputs, capacity: Capacity) -> list[PhaseMemory]:
    """Prefill and decode of one rollout batch; decode is skipped when prefill does not fit."""
    static, prompts, key = _rollout_inputs(inputs)
    first, compiled = compile_phase("rollout prefill", functools.partial(prefill.lower, **static),
                                    (inputs.forward_params, prompts, prompts, key), inputs.held_beside_rollout)
    if compiled is None:
        return [first]  # decode's inputs are prefill's outputs
    cache, state = abstract_outputs(compiled)
    return [first, decode_phase(inputs, static, (inputs.forward_params, cache, state, key), capacity)]


def decode_phase(inputs: PlanInputs, static: dict[str, Any], args: tuple, capacity: Capacity) -> PhaseMemory:
    """The decode loop as the run executes it: with gather_weights=auto, gathered when the
    gathered decode leaves GATHER_HEADROOM of the capacity free (grpo_rollout.gather applies
    the same rule on devices)."""
    def compile_decode(gather: bool) -> tuple[PhaseMemory, Any]:
        lower = functools.partial(decode.lower, **{**static, "gather_weights": gather})
        return compile_phase("rollout decode", lower, args, inputs.held_beside_rollout)

    auto_note = ""
    if inputs.rollout.options.gather_weights == "auto" and has_sharded_weights(inputs.forward_params):
        gathered, decoder = compile_decode(True)
        limit = capacity.bytes * (1 - GATHER_HEADROOM)
        if decoder is not None and gathered.total <= limit:
            return dataclasses.replace(gathered, note="gather_weights=auto: weights gathered once per rollout (the "
                                       f"copy fits); {decode_traffic_note(decoder, True)}")
        auto_note = (f"gather_weights=auto: sharded weights (a gathered decode needs {gathered.total / GIB:.2f} GiB, "
                     f"over {limit / GIB:.2f}: {GATHER_HEADROOM:.0%} of {capacity.gib:.2f} kept free); ")
    second, decoder = compile_decode(static["gather_weights"])
    if decoder is None:
        return second
    return dataclasses.replace(second, note=auto_note + decode_traffic_note(decoder, static["gather_weights"]))


def decode_traffic_note(decoder: Any, gathered: bool) -> str:
    """The collectives the compiled decode loop runs for every token, per device."""
    traffic = decode_collective_bytes_per_token(decoder)
    if not traffic:
        return "collectives per decoded token: none"
    listed = ", ".join(f"{kind} {size / (1 << 20):.1f} MiB" for kind, size in sorted(traffic.items()))
    hint = ("" if gathered else "; rollout.options.gather_weights=true gathers FSDP-sharded weights once per "
            "rollout instead (a full compute-dtype copy per device)")
    return f"collectives per decoded token: {listed}{hint}"


def logps_phase(inputs: PlanInputs) -> Optional[PhaseMemory]:
    """The full-batch scoring forward the loop runs for old (ppo_epochs > 1) or reference
    (loss.beta > 0) log-probs; None when the run never calls it."""
    program = inputs.program
    if not (program.scores_ref_logps or program.scores_old_logps):
        return None
    batch = abstract_update_batch(inputs)
    lower = functools.partial(program.score.lower, prompt_width=batch.prompt_width)
    args = (inputs.forward_params, batch.input_ids, batch.attention_mask, batch.targets)
    return compile_phase("log-probs", lower, args, inputs.held_beside_rollout)[0]


def _update_lowering(inputs: PlanInputs, cfg: RunConfig) -> tuple[Callable[..., Any], tuple]:
    """(lower, abstract args) of one optimizer update over the widest batch, micro-batched as `cfg.train` says."""
    program = inputs.program.with_micro_batch_size(cfg.train.micro_batch_size_per_device)
    return program.update.lower, (inputs.params, inputs.opt_state, abstract_update_batch(inputs))


def compile_update(inputs: PlanInputs, cfg: RunConfig) -> Any:
    lower, args = _update_lowering(inputs, cfg)
    return lower(*args).compile()


def train_phase(inputs: PlanInputs, cfg: RunConfig) -> PhaseMemory:
    lower, args = _update_lowering(inputs, cfg)
    return compile_phase("train step", lower, args, inputs.reference_bytes)[0]


# ---- capacity ----------------------------------------------------------------------------
def device_capacity(capacity_gib: Optional[float], target: Optional[Target] = None) -> Capacity:
    """Per-device memory budget: the flag, the target chip's HBM, the accelerator's limit,
    or host memory shared by the local CPU devices."""
    if capacity_gib is not None:
        if capacity_gib <= 0:
            raise UserError(f"--capacity-gib {capacity_gib} must be > 0; give the per-device memory in GiB "
                            "(31.25 for a TPU v6e chip)")
        return Capacity(int(capacity_gib * GIB), "--capacity-gib")
    if target is not None:
        return Capacity(int(target.generation.hbm_gib * GIB), f"{target.generation.name} HBM, {HBM_SOURCE}")
    devices = jax.local_devices()
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        return Capacity(min(s["bytes_limit"] for s in stats), f"{devices[0].device_kind} bytes_limit")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Capacity(host // len(devices), f"host memory {host / GIB:.2f} GiB / {len(devices)} CPU devices")


# ---- report ----------------------------------------------------------------------------
COLUMNS = ("arguments", "outputs", "aliased", "temp", "other", "total")


def table_lines(phases: list[PhaseMemory]) -> list[str]:
    lines = [f"{'per device (GiB)':<18}" + "".join(f"{c:>11}" for c in COLUMNS)]
    for p in phases:
        values = (p.arguments, p.outputs, p.aliased, p.temp, p.other, p.total)
        lines.append(f"{p.name:<18}" + "".join(f"{v / GIB:>11.3f}" for v in values)
                     + ("  refused by the compiler: over HBM (temp as it reported)" if p.refused else ""))
    return lines + [f"  {p.name}: {p.note}" for p in phases if p.note]


def header_lines(inputs: PlanInputs) -> list[str]:
    cfg, mesh, q = inputs.cfg, inputs.mesh, inputs.qcfg
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(inputs.params))
    rows, (prompt_w, completion_w) = rows_per_step(cfg), train_widths(inputs)
    data_devices = batch_shard_count(mesh, TRAIN_BATCH_AXES)
    micro = micro_batches(cfg, mesh)
    return [
        f"model: {q.model_type}, {params / 1e9:.3f}B params, {cfg.model.param_dtype} masters, {cfg.model.dtype} "
        f"compute, {moment_dtype(cfg)} moments, remat={cfg.model.remat}; mesh "
        + " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
        + f" on {mesh.size} {mesh.devices.flat[0].device_kind} device(s)",
        figures_line(inputs),
        f"rollout: {rows} rows x (prompt bucket {prompt_bucket(inputs)} + {cfg.rollout.max_new_tokens} new tokens), "
        f"rollout.sharding={cfg.rollout.sharding}",
        f"train step: {rows} rows x {prompt_w + completion_w} tokens ({prompt_w} prompt + {completion_w} completion), "
        f"{micro} micro-batch(es) of {rows // micro // data_devices} row(s) per device",
    ]


def figures_line(inputs: PlanInputs) -> str:
    if inputs.target:
        return f"figures: the TPU compiler's (libtpu) for {inputs.target}"
    backend = jax.default_backend()
    if backend == "cpu":
        scheduler = (f", scheduled for memory as accelerators do (XLA_FLAGS has {CPU_MEMORY_SCHEDULER_FLAG})"
                     if CPU_MEMORY_SCHEDULER_FLAG in os.environ.get("XLA_FLAGS", "") else "")
        return (f"figures: XLA:CPU's, for this host's CPU devices (not a TPU's or GPU's){scheduler}; "
                "--target <slice> gives the TPU compiler's")
    return f"figures: the {backend} compiler's, for this host's devices"


def footer_lines(inputs: PlanInputs) -> list[str]:
    lines = ["aliased: outputs written into donated argument buffers (counted once); other: device state that is "
             "not an argument of the phase (optimizer state and float32 masters during rollout, which runs on "
             "their compute-dtype copy; reference params when loss.beta > 0)"]
    if not inputs.target and jax.default_backend() == "cpu" and inputs.cfg.model.dtype == "bfloat16":
        lines.append("note: XLA:CPU upcasts bfloat16 matmul operands to float32, so the temp of a bfloat16 model "
                     "is overstated on CPU; compile on the accelerator for its exact figure")
    return lines


def peak(phases: list[PhaseMemory]) -> PhaseMemory:
    return max(phases, key=lambda p: p.total)


def peak_line(phases: list[PhaseMemory], capacity: Capacity) -> str:
    top = peak(phases)
    verdict = "fits" if top.total <= capacity.bytes else "DOES NOT FIT"
    return (f"peak: {top.total / GIB:.3f} GiB per device ({top.name}) of {capacity.gib:.2f} GiB "
            f"({capacity.source}): {verdict}, {100 * top.total / capacity.bytes:.0f}% used")


def does_not_fit_message(phase: PhaseMemory, capacity: Capacity, cfg: RunConfig) -> str:
    memory = "HBM" if "HBM" in capacity.source else "capacity"
    needs = (f"{phase.name} needs {phase.total / GIB:.2f} GiB per device, exceeds {memory} by "
             f"{(phase.total - capacity.bytes) / GIB:.2f} GiB (capacity {capacity.gib:.2f} GiB)")
    if phase.name in ("rollout prefill", "rollout decode"):
        return (f"{needs}: lower rollout.prompts_per_step, rollout.n or rollout.max_new_tokens, set "
                "rollout.options.cache_dtype=bfloat16, or use more devices")
    remat = {"none": " or enable model.remat (dots or full)", "dots": " or set model.remat=full"}
    return (f"{needs}: lower train.micro_batch_size_per_device (largest that fits: run --sweep "
            f"micro_batch_size_per_device){remat.get(cfg.model.remat, '')}")


def fixed_phases(inputs: PlanInputs, capacity: Capacity) -> list[PhaseMemory]:
    """The phases that do not depend on the micro-batch size."""
    return rollout_phases(inputs, capacity) + [p for p in [logps_phase(inputs)] if p is not None]


# ---- commands ----------------------------------------------------------------------------
def plan_once(inputs: PlanInputs, capacity: Capacity) -> int:
    phases = fixed_phases(inputs, capacity) + [train_phase(inputs, inputs.cfg)]
    print("\n".join(header_lines(inputs) + table_lines(phases) + footer_lines(inputs)))
    print(peak_line(phases, capacity))
    top = peak(phases)
    if top.total <= capacity.bytes:
        return 0
    print(f"grpo-run: does not fit: {does_not_fit_message(top, capacity, inputs.cfg)}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def micro_batch_candidates(inputs: PlanInputs) -> list[int]:
    """Valid micro_batch_size_per_device values: divisors of the rows each data device holds."""
    mesh = inputs.mesh
    per_device = rows_per_step(inputs.cfg) // batch_shard_count(mesh, TRAIN_BATCH_AXES)
    return [size for size in range(1, per_device + 1) if per_device % size == 0]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> Optional[int]:
    """Binary search for the largest candidate that fits; memory grows with the micro-batch
    size, so everything below a fitting size fits too."""
    low, high, best = 0, len(candidates) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            best, low = candidates[middle], middle + 1
        else:
            high = middle - 1
    return best


def sweep_micro_batch(inputs: PlanInputs, capacity: Capacity) -> int:
    fixed = fixed_phases(inputs, capacity)
    print("\n".join(header_lines(inputs)))
    print(f"sweep micro_batch_size_per_device over {micro_batch_candidates(inputs)} against "
          f"{capacity.gib:.2f} GiB ({capacity.source}); rollout peak {peak(fixed).total / GIB:.3f} GiB")
    tried: dict[int, list[PhaseMemory]] = {}

    def fits(size: int) -> bool:
        tried[size] = fixed + [train_phase(inputs, with_micro_batch_size(inputs.cfg, size))]
        top = peak(tried[size])
        ok = top.total <= capacity.bytes
        print(f"  micro_batch_size_per_device={size}: train step {tried[size][-1].total / GIB:.3f} GiB, "
              f"peak {top.total / GIB:.3f} GiB ({top.name}): {'fits' if ok else 'does not fit'}", flush=True)
        return ok

    best = largest_fitting(micro_batch_candidates(inputs), fits)
    return report_sweep(inputs, capacity, best, tried, fixed)


def report_sweep(inputs: PlanInputs, capacity: Capacity, best: Optional[int],
                 tried: dict[int, list[PhaseMemory]], fixed: list[PhaseMemory]) -> int:
    if best is not None:
        print("\n".join(table_lines(tried[best]) + footer_lines(inputs)))
        print(f"largest micro_batch_size_per_device that fits: {best} (peak {peak(tried[best]).total / GIB:.3f} "
              f"GiB per device of {capacity.gib:.2f} GiB)")
    else:
        print(f"no micro_batch_size_per_device fits in {capacity.gib:.2f} GiB per device", file=sys.stderr)
    print(json.dumps({"sweep": "micro_batch_size_per_device", "largest_fitting": best,
                      "peak_gib": round(peak(tried[best]).total / GIB, 4) if best else None,
                      "capacity_gib": round(capacity.gib, 4),
                      "tried": {str(k): round(peak(v).total / GIB, 4) for k, v in sorted(tried.items())}}))
    if best is None:
        smallest = tried[min(tried)][-1]
        reason = (does_not_fit_message(peak(fixed), capacity, inputs.cfg) if peak(fixed).total > capacity.bytes
                  else f"even micro_batch_size_per_device={min(tried)} needs {smallest.total / GIB:.2f} GiB per "
                       f"device: enable model.remat (dots or full), use more devices, or shorten the sequences")
        print(f"grpo-run: does not fit: {reason}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def check_sweep_field(sweep: Optional[str]) -> None:
    if sweep is not None and sweep not in SWEEP_FIELDS:
        raise UserError(f"--sweep {sweep!r} is not supported; supported: {', '.join(SWEEP_FIELDS)}")


CPU_MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def use_memory_minimizing_cpu_scheduler() -> None:
    """XLA:CPU's default scheduler favours thread concurrency and keeps every unrolled
    layer's attention buffers alive at once, which hides what remat saves (a 4-layer
    Qwen2.5-3B step: 25.9 GiB temp with it, 7.5 GiB without). Accelerators schedule for
    memory already; the flag is read when the backend starts, so set it before that."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_MEMORY_SCHEDULER_FLAG}".strip()


def plan_command(cfg: RunConfig, registry: Registry, sweep: Optional[str] = None,
                 capacity_gib: Optional[float] = None, target: Optional[str] = None) -> int:
    """Prints the memory plan; 0 when the run fits, EXIT_DOES_NOT_FIT otherwise."""
    use_memory_minimizing_cpu_scheduler()
    check_sweep_field(sweep)
    parsed = parse_target(target) if target is not None else None
    capacity = device_capacity(capacity_gib, parsed)
    inputs = build_plan_inputs(cfg, registry, parsed)
    if sweep:
        return sweep_micro_batch(inputs, capacity)
    return plan_once(inputs, capacity)
