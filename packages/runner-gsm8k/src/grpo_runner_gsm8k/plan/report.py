"""The plan's printed report: header, per-phase table, verdict and the fix when it does not fit."""

from __future__ import annotations

import math
import os

import jax

from grpo_core.config import RolloutConfig
from grpo_meshes import TRAIN_BATCH_AXES, batch_shard_count

from grpo_runner_gsm8k.assembly.build import micro_batches, rows_per_step
from grpo_runner_gsm8k.costs.capacity import GIB
from grpo_runner_gsm8k.plan.abstract import PlanInputs, per_device_bytes, prompt_bucket, train_widths
from grpo_runner_gsm8k.costs.memory import PhaseMemory
from grpo_runner_gsm8k.plan.scheduler import CPU_MEMORY_SCHEDULER_FLAG
from grpo_runner_gsm8k.samplers.partial import slot_count


COLUMNS = ("arguments", "outputs", "aliased", "temp", "other", "total")


def table_lines(phases: list[PhaseMemory]) -> list[str]:
    width = max([18] + [len(p.name) + 1 for p in phases])  # a decode segment's name is longer
    lines = [f"{'per device (GiB)':<{width}}" + "".join(f"{c:>11}" for c in COLUMNS)]
    for p in phases:
        values = (p.arguments, p.outputs, p.aliased, p.temp, p.other, p.total)
        lines.append(f"{p.name:<{width}}" + "".join(f"{v / GIB:>11.3f}" for v in values)
                     + ("  refused by the compiler: over HBM (temp as it reported)" if p.refused else ""))
    return lines + [f"  {p.name}: {p.note}" for p in phases if p.note]


def header_lines(inputs: PlanInputs) -> list[str]:
    cfg, mesh, q = inputs.run.cfg, inputs.run.mesh, inputs.run.qcfg
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(inputs.params))
    rows, (prompt_w, completion_w) = rows_per_step(cfg.rollout), train_widths(inputs)
    data_devices = batch_shard_count(mesh, TRAIN_BATCH_AXES)
    micro = micro_batches(cfg.rollout, cfg.train, mesh)
    return [
        f"model: {q.model_type}, {trained_line(inputs, params)}, {cfg.model.dtype} "
        f"compute, {cfg.train.moment_dtype} moments, remat={cfg.model.remat}; mesh "
        + " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
        + f" on {mesh.size} {mesh.devices.flat[0].device_kind} device(s)",
        figures_line(inputs),
        f"rollout: {rows} rows x (prompt bucket {prompt_bucket(inputs)} + {cfg.rollout.max_new_tokens} new tokens), "
        f"rollout.sharding={cfg.rollout.sharding}" + partial_text(cfg.rollout),
        f"train step: {rows} rows x {prompt_w + completion_w} tokens ({prompt_w} prompt + {completion_w} completion), "
        f"{micro} micro-batch(es) of {rows // micro // data_devices} row(s) per device",
    ] + teacher_lines(inputs) + reward_model_lines(inputs)


def partial_text(rollout: RolloutConfig) -> str:
    if not rollout.partial.enabled:
        return ""
    return f"; partial rollouts: {slot_count(rollout)} slots, rounds of {rollout.partial.budget} tokens"


TEACHER_WORK = {"sampled": "scores every sampled token after the rollout",
                "full": "computes its hidden states at every completion position after the rollout; the update "
                        "adds the exact reverse KL through its LM head"}


def teacher_lines(inputs: PlanInputs) -> list[str]:
    """The distillation teacher's weights, when there is one."""
    teacher, cfg = inputs.run.teacher, inputs.run.cfg.teacher
    if teacher is None:
        return []
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(teacher.params))
    return [f"teacher: {teacher.qcfg.model_type}, {params:,} params in {cfg.dtype}, {cfg.placement} "
            f"({inputs.teacher_bytes / GIB:.3f} GiB per device), " + TEACHER_WORK[cfg.estimator]]


def reward_model_lines(inputs: PlanInputs) -> list[str]:
    """The `reward_model` reward's weights and batch, when there is one."""
    model = inputs.run.reward_model
    if model is None:
        return []
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves((model.params, model.head)))
    return [f"reward model: {model.qcfg.model_type}, {params:,} params in {model.head.dtype}, sharded "
            f"({inputs.reward_model_bytes / GIB:.3f} GiB per device), scores {model.rows} conversation(s) of up to "
            f"{model.width} tokens per forward after the rollout"]


def trained_line(inputs: PlanInputs, params: int) -> str:
    """What trains: every param in its master dtype, or LoRA adapters on a frozen base."""
    if inputs.frozen is None:
        return f"{params / 1e9:.3f}B params, {inputs.run.cfg.model.param_dtype} masters"
    base = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(inputs.frozen))
    state = per_device_bytes(inputs.params) + per_device_bytes(inputs.opt_state)
    return (f"LoRA r={inputs.run.cfg.model.lora.rank}: {params / 1e6:.2f}M float32 adapter params ({params / base:.2%} "
            f"of the {base / 1e9:.3f}B frozen base, stored in {inputs.run.cfg.model.dtype}; adapters + optimizer "
            f"state {state / GIB:.3f} GiB per device)")


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
             "their compute-dtype copy; reference params when loss.beta > 0; the teacher's and reward model's params)"]
    if not inputs.target and jax.default_backend() == "cpu" and inputs.run.cfg.model.dtype == "bfloat16":
        lines.append("note: XLA:CPU upcasts bfloat16 matmul operands to float32, so the temp of a bfloat16 model "
                     "is overstated on CPU; compile on the accelerator for its exact figure")
    return lines
