"""`grpo-run --plan --target SLICE`: projected time of a step, per phase, from the compiled programs.

A roofline per phase and device: max(matmul FLOPs / peak bf16 FLOP/s, HBM bytes / HBM bandwidth,
asynchronous collectives) + synchronous collectives (the compiled schedule says which overlap
compute), each collective costing the chip's collective latency plus its bytes over the ICI
bandwidth, with the chip figures of tpu_target's table (the latency a derived figure, so the plan
also prints the step at half and double it). FLOPs count every loop body times its trip count; attention
run as a kernel (splash, cudnn: a custom call the HLO counts as zero) is added analytically.
HBM bytes are a lower bound (grpo_runner_gsm8k.costs.roofline). So the projection is a lower bound, not a measurement:

    step = prefill + (completion tokens - 1) x decode step + update (all micro-batches)
           + log-probs (when the run scores old or reference log-probs)
           + teacher log-probs (with a distillation teacher)

A segmented decode (rollout.options.decode_segments, grpo_rollout.segments) is priced per segment:
segment k's per-step cost x its steps among 1 .. tokens - 1, plus its setup (the weight gather or
reshard each call runs once), for each segment that starts before the last token.

The prefill samples each row's first token; the update is compiled at the widest training batch
(the longest completion), at both lengths.

Across slices (`mesh.slices`, a target such as 2xv6e-8), a collective whose device groups span
slices crosses the data-center network: it costs the DCN latency plus its bytes over the chip's
share of its host's DCN bandwidth instead (costs.roofline), and the plan lists per phase what
crosses it (with dp across slices: the train step's gradient reduction, nothing per decoded token).
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import asdict, dataclass
from typing import Optional

from grpo_core.config import ModelConfig
from grpo_core.models import QwenConfig
from grpo_rollout.segments import decode_phase_steps

from grpo_runner_gsm8k.assembly.build import attention_impl, micro_batches, rows_per_step
from grpo_runner_gsm8k.costs.flops import forward_flops
from grpo_runner_gsm8k.plan.abstract import PlanInputs, plannable, train_widths
from grpo_runner_gsm8k.samplers.partial import kv_cache_mode, slot_count
from grpo_runner_gsm8k.costs.memory import PhaseMemory
from grpo_runner_gsm8k.costs.roofline import NO_COLLECTIVES, PhaseCost, call_seconds, dcn_chip_gbps, setup_seconds
from grpo_runner_gsm8k.assembly.teacher import TEACHER_PHASE
from grpo_runner_gsm8k.costs.tpu_target import Generation

KERNEL_ATTENTION = ("splash", "cudnn")  # custom calls: their FLOPs are not in the HLO
# The forward kernel's 2 matmuls per block, then the backward's dq and dkv kernels: 7 more, as both
# recompute the scores; in units of a forward.
SPLASH_TRAIN_PASSES = 1 + 7 / 2
LATENCY_SCALES = (0.5, 1.0, 2.0)  # the collective latency is derived: the step is shown at each multiple


@dataclass(frozen=True)
class PhaseTime:
    name: str
    flops: float  # per device, analytic attention included
    hbm_bytes: int
    collective_bytes: int  # synchronous
    overlapped_collective_bytes: int
    seconds: float
    setup_seconds: float = 0.0  # once around a decode loop (the weight gather)
    cost: PhaseCost | None = None  # what the times were computed from

    @property
    def collectives(self) -> int:
        """Collectives issued per call (per decoded token for the decode), synchronous or not."""
        return self.cost.collectives + self.cost.overlapped_collectives if self.cost else 0

    def on(self, chip: Generation) -> "PhaseTime":
        """The same phase timed on `chip` (other figures, another collective latency)."""
        return dataclasses.replace(self, seconds=call_seconds(chip, self.cost, self.flops),
                                   setup_seconds=setup_seconds(chip, self.cost))


def attention_flops(q: QwenConfig, rows: int, width: int) -> float:
    """QK^T and PV over the causal pairs of one forward (grpo_runner_gsm8k.costs.flops)."""
    return 2.0 * q.num_hidden_layers * q.num_attention_heads * q.head_dim * rows * width * (width + 1)


def kernel_attention_flops(inputs: PlanInputs, phase: PhaseMemory) -> float:
    """Per device: the attention FLOPs the training batch runs inside kernels its HLO does not count
    (the prompt pass with a cache and the decode attend in XLA, which the HLO counts)."""
    run, cfg = inputs.run, inputs.run.cfg
    passes = {"log-probs": 1.0, TEACHER_PHASE: 1.0,
              "train step": SPLASH_TRAIN_PASSES + (cfg.model.remat != "none")}.get(phase.name, 0.0)
    if not passes or not phase.cost.custom_calls or attention_impl(cfg.model, run.mesh) not in KERNEL_ATTENTION:
        return 0.0
    padded = -(-sum(train_widths(inputs)) // 128) * 128  # splash pads the sequence to 128s
    model = run.teacher.qcfg if phase.name == TEACHER_PHASE else run.qcfg
    return passes * attention_flops(model, rows_per_step(cfg.rollout), padded) / run.mesh.size


def phase_time(inputs: PlanInputs, chip: Generation, phase: PhaseMemory) -> PhaseTime:
    cost: PhaseCost = phase.cost
    flops = cost.flops + kernel_attention_flops(inputs, phase)
    return PhaseTime(phase.name, flops, cost.hbm_bytes, cost.collective_bytes, cost.overlapped_collective_bytes,
                     call_seconds(chip, cost, flops), setup_seconds(chip, cost), cost)


# A partial-rollout round's phases besides its decode (grpo_rollout.kept_plan, backend.compile_phases):
# each generate call moves the weights to the decode layout, admits and compacts (the 8-bit copy,
# `rollout quantize`, is made once per step).
ROUND_PHASES = ("rollout prefill", "rollout compaction", "rollout admission", "rollout prompt table",
                "rollout decode layout")
CARRIED_ADMISSION = "rollout admission of carried rows"


@dataclass(frozen=True)
class PartialRounds:
    """A step of partial rollouts (rollout.partial) in the steady state where every row is `tokens`
    long: a row holds its slot for ceil(tokens / budget) rounds and the slots serve `slots` rows a
    round, so a step that trains `rows` rows runs rows x ceil(tokens / budget) / slots rounds on
    average (a step whose groups are already complete decodes nothing: grpo_rollout.partial).
    carried_admission: how often the carried rows are admitted again ("round": re-prefilled on a
    prompt table; "step": kv_cache within_step, under each step's new weights; "never")."""

    slots: int
    rows: int
    budget: int
    carried_admission: str = "never"

    def rounds(self, tokens: int) -> float:
        return self.rows * -(-tokens // self.budget) / self.slots


@dataclass(frozen=True)
class Projection:
    chip: Generation
    chips: int
    rows: int
    micro_batches: int
    epochs: int  # train.ppo_epochs: updates per step
    phases: dict[str, PhaseTime]
    model_update_flops: float  # model_update_passes x forward of the widest training batch, all devices
    slices: int = 1  # mesh.slices: collectives across them are priced over the DCN
    partial: Optional[PartialRounds] = None  # partial rollouts: the rollout runs in rounds

    def decode_segments(self) -> list[tuple[int, Optional[int], PhaseTime]]:
        """(first step, end step, phase) of each decode segment in step order; the last, `rollout
        decode`, runs to the end (None). One segment for an unsegmented decode."""
        earlier = sorted((decode_phase_steps(name), p) for name, p in self.phases.items() if decode_phase_steps(name))
        first = earlier[-1][0][1] if earlier else 1
        return [(a, b, p) for (a, b), p in earlier] + [(first, None, self.phases["rollout decode"])]

    def decode_seconds(self, tokens: int) -> float:
        """Decode steps 1 .. tokens - 1: each segment the host calls (those starting before the last
        token), its setup and its steps; with partial rollouts, every round's decode loop."""
        if self.partial is not None:
            decode = self.phases["rollout decode"]
            return self.partial.rounds(tokens) * (decode.setup_seconds + self.round_steps(tokens) * decode.seconds)
        total = 0.0
        for first, end, phase in self.decode_segments():
            if first < max(tokens, 2):
                total += phase.setup_seconds + (min(tokens, end or tokens) - first) * phase.seconds
        return total

    @property
    def update_seconds(self) -> float:
        """The train step's projected seconds, and at least its model FLOPs at the slice's peak: the
        compiler's cost analysis does not count FLOPs inside a Pallas kernel (the MoE's grouped matmul)."""
        return max(self.phases["train step"].seconds, self.model_update_flops / self.peak_flops)

    @property
    def peak_flops(self) -> float:
        return self.chip.peak_tflops * 1e12 * self.chips

    def round_steps(self, tokens: int) -> int:
        """A partial-rollout round's decode steps: `budget` tokens, the first sampled by a prefill
        where the round runs one (re-prefilled rows), fewer when rows are shorter."""
        return min(self.partial.budget, tokens) - ("rollout prefill" in self.phases)

    def step_seconds(self, tokens: int) -> float:
        once = [name for name in self.phases if name not in ("rollout decode", "train step")
                and not decode_phase_steps(name)]
        if self.partial is not None:
            once = [name for name in once if name not in ROUND_PHASES and name != CARRIED_ADMISSION]
        return (sum(self.phases[name].seconds for name in once) + self.rollout_rounds_seconds(tokens)
                + self.decode_seconds(tokens) + self.epochs * self.update_seconds)

    def rollout_rounds_seconds(self, tokens: int) -> float:
        """Partial rollouts: what each round runs besides its decode loop, and the carried rows'
        admissions; 0 for a synchronous rollout (its prefill is priced once with the other phases)."""
        if self.partial is None:
            return 0.0
        per_round = sum(p.seconds for name, p in self.phases.items() if name in ROUND_PHASES)
        admission = self.phases.get(CARRIED_ADMISSION)
        admitted = admission.seconds if admission else 0.0
        rounds = self.partial.rounds(tokens)
        return (rounds * (per_round + admitted * (self.partial.carried_admission == "round"))
                + admitted * (self.partial.carried_admission == "step"))

    def with_latency_scale(self, scale: float) -> "Projection":
        """The same compiled programs (the decode layout chosen at the table's latency) with the
        collective latency multiplied by `scale`."""
        chip = dataclasses.replace(self.chip, collective_latency_us=self.chip.collective_latency_us * scale)
        return dataclasses.replace(self, chip=chip, phases={name: p.on(chip) for name, p in self.phases.items()})

    def tokens_per_second(self, tokens: int) -> float:
        return self.rows * tokens / self.step_seconds(tokens)

    @property
    def mfu(self) -> float:
        """Model FLOPs of the update over what the slice's peak does in its projected time."""
        return self.model_update_flops / (self.update_seconds * self.peak_flops)


def model_update_passes(model_cfg: ModelConfig) -> int:
    """Forward passes worth of model FLOPs in an update: forward + a backward of twice that, or,
    for a frozen (LoRA) base, a backward of activation gradients only (adapters left out)."""
    return 2 if model_cfg.lora.rank else 3


def project(inputs: PlanInputs, chip: Generation, phases: list[PhaseMemory]) -> Optional[Projection]:
    """None when a phase was refused (nothing to project) or the rollout has no decode loop."""
    if any(p.cost is None for p in phases) or "rollout decode" not in {p.name for p in phases}:
        return None
    cfg, mesh = inputs.run.cfg, inputs.run.mesh
    prompt_w, completion_w = train_widths(inputs)
    rows = rows_per_step(cfg.rollout)
    model = model_update_passes(cfg.model) * forward_flops(inputs.run.qcfg, rows, prompt_w + completion_w, completion_w)
    return Projection(chip, mesh.size, rows, micro_batches(cfg.rollout, cfg.train, mesh), cfg.train.ppo_epochs,
                      {p.name: phase_time(inputs, chip, p) for p in phases}, model, cfg.mesh.slices,
                      partial_rounds(inputs))


def partial_rounds(inputs: PlanInputs) -> Optional[PartialRounds]:
    """How the run's partial rollouts (rollout.partial) are priced; None without them."""
    rollout = inputs.run.cfg.rollout
    if not rollout.partial.enabled:
        return None
    mode = kv_cache_mode(rollout, plannable(inputs.run))
    admission = "round" if mode == "reprefill" else "step" if mode == "within_step" else "never"
    return PartialRounds(slot_count(rollout), rows_per_step(rollout), rollout.partial.budget, admission)


def projection_lines(projection: Projection, lengths: list[int]) -> list[str]:
    chip = projection.chip
    labels = {name: phase_label(projection, name) for name in projection.phases}
    width = max([26] + [len(label) + 1 for label in labels.values()])
    lines = [f"projected time per device: a lower bound from the TPU compiler's programs, not a measurement "
             f"({chip.name}: {chip.peak_tflops:g} TFLOP/s bf16, {chip.hbm_gbps:g} GB/s HBM, {chip.ici_gbps:g} GB/s "
             f"ICI per chip, {chip.collective_latency_us:g} us per collective ({chip.latency_source}); collectives "
             "the schedule issues asynchronously overlap compute, the rest add to it)",
             f"{'per device':<{width}}{'TFLOP':>10}{'HBM GB':>10}{'sync MB':>10}{'async MB':>10}{'colls':>8}{'time':>12}"]
    for p in table_order(projection):
        lines.append(f"{labels[p.name]:<{width}}{p.flops / 1e12:>10.3f}{p.hbm_bytes / 1e9:>10.3f}"
                     f"{p.collective_bytes / 1e6:>10.1f}{p.overlapped_collective_bytes / 1e6:>10.1f}{p.collectives:>8}"
                     f"{seconds_text(p.seconds):>12}")
    floor = projection.update_seconds > projection.phases["train step"].seconds
    lines.append(f"train micro-batch: {seconds_text(projection.update_seconds / projection.micro_batches)} "
                 f"({projection.micro_batches} per update); train MFU {projection.mfu:.1%}"
                 + ("; the update taken at its model FLOPs at peak (the compiler's count misses the FLOPs of "
                    "Pallas kernels)" if floor else ""))
    return (lines + dcn_lines(projection) + [step_line(projection, tokens) for tokens in lengths]
            + [latency_line(projection, lengths)])


def dcn_text(phase: PhaseTime) -> str:
    """What of one phase crosses the DCN, per call (per token for a decode) and once around a decode loop."""
    dcn = phase.cost.dcn if phase.cost else NO_COLLECTIVES
    setup = phase.cost.setup_dcn if phase.cost else NO_COLLECTIVES
    per = " per token" if phase.cost and phase.cost.per_iteration else ""
    text = f"{dcn.total_bytes / 1e6:.1f} MB in {dcn.total} collective(s){per}" if dcn.total else f"none{per}"
    return text + (f", {setup.total_bytes / 1e6:.1f} MB in {setup.total} once per rollout" if setup.total else "")


def dcn_lines(projection: Projection) -> list[str]:
    """Per phase, the collectives across slices (a multi-slice mesh only)."""
    if projection.slices == 1:
        return []
    chip = projection.chip
    phases = "; ".join(f"{name}: {dcn_text(p)}" for name, p in projection.phases.items())
    return [f"across the {projection.slices} slices (DCN: {dcn_chip_gbps(chip):g} GB/s per chip = "
            f"{chip.dcn_host_gbps:g} GB/s per host ({chip.dcn_source}) over {chip.host_chips} chips, "
            f"{chip.dcn_latency_us:g} us per collective ({chip.dcn_latency_source})), per device: {phases}"]


def table_order(projection: Projection) -> list[PhaseTime]:
    """The phases in the order they were compiled, a segmented decode's segments in step order."""
    segments = [p for _, _, p in projection.decode_segments()]
    ordered: list[PhaseTime] = []
    for p in projection.phases.values():
        if p.name == "rollout decode":
            ordered += segments
        elif not decode_phase_steps(p.name):
            ordered.append(p)
    return ordered


def phase_label(projection: Projection, name: str) -> str:
    """A phase's row label; a decode's rows are per token (a segmented decode's last segment runs to the end)."""
    segments = projection.decode_segments()
    if name != "rollout decode":
        return name
    return f"rollout decode steps {segments[-1][0]}-" if len(segments) > 1 else "rollout decode (1 token)"


def latency_line(projection: Projection, lengths: list[int]) -> str:
    """The step at each LATENCY_SCALES multiple of the collective latency, and without it."""
    def steps(scaled: Projection) -> str:
        return " / ".join(f"{scaled.step_seconds(tokens):.2f} s" for tokens in lengths)

    listed = ", ".join(f"{scale:g}x {steps(projection.with_latency_scale(scale))}" for scale in LATENCY_SCALES)
    return (f"collective latency sensitivity, step at {' / '.join(map(str, lengths))} tokens (decode layout as "
            f"chosen at 1x): {listed}; none {steps(projection.with_latency_scale(0.0))}")


def step_line(projection: Projection, tokens: int) -> str:
    segments = projection.decode_segments()
    steps = f"{tokens - 1} decode steps x {seconds_text(segments[0][2].seconds)}"
    if projection.partial is not None:
        partial = projection.partial
        rounds = partial.rounds(tokens)
        steps = (f"{rounds:g} round{'' if rounds == 1 else 's'} of {projection.round_steps(tokens)} decode steps x "
                 f"{seconds_text(segments[0][2].seconds)} on {partial.slots} slots")
    elif len(segments) > 1:
        called = sum(first < max(tokens, 2) for first, _, _ in segments)
        steps = (f"{tokens - 1} decode steps in {called} of {len(segments)} segments, "
                 f"{seconds_text(projection.decode_seconds(tokens))}")
    return (f"projected step at {tokens} completion tokens per row: {projection.step_seconds(tokens):.2f} s "
            f"({steps}), {projection.tokens_per_second(tokens):,.0f} completion tokens/s")


def seconds_text(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def steps_json(projection: Projection, lengths: list[int]) -> list[dict]:
    return [{"completion_tokens": t, "step_seconds": projection.step_seconds(t),
             "decode_seconds": projection.decode_seconds(t), "completion_tokens_per_second": projection.tokens_per_second(t)} for t in lengths]


def segments_json(projection: Projection) -> list[dict]:
    """Each decode segment's steps and per-step cost (one entry for an unsegmented decode)."""
    return [{"phase": p.name, "first_step": first, "end_step": end, "seconds_per_step": p.seconds,
             "setup_seconds": p.setup_seconds, "hbm_gb_per_device_per_step": p.hbm_bytes / 1e9}
            for first, end, p in projection.decode_segments()]


def projection_json(projection: Projection, lengths: list[int]) -> str:
    return json.dumps({"projection": {
        "kind": "lower bound from the TPU compiler's programs, not a measurement",
        "chip": {k: v for k, v in asdict(projection.chip).items() if k in (
            "name", "peak_tflops", "hbm_gbps", "ici_gbps", "usable_hbm_gib", "collective_latency_us",
            "latency_source", "dcn_host_gbps", "dcn_latency_us", "dcn_source", "host_chips")},
        "slices": projection.slices,
        "phases": {p.name: {"tflop_per_device": p.flops / 1e12, "hbm_gb_per_device": p.hbm_bytes / 1e9,
                            "sync_collective_mb_per_device": p.collective_bytes / 1e6,
                            "async_collective_mb_per_device": p.overlapped_collective_bytes / 1e6,
                            "collectives": p.collectives, "seconds": p.seconds, **dcn_json(p),
                            "setup_seconds": p.setup_seconds} for p in projection.phases.values()},
        "train_micro_batch_seconds": projection.update_seconds / projection.micro_batches,
        "train_mfu": projection.mfu,
        "steps": steps_json(projection, lengths),
        "decode_segments": segments_json(projection),
        "latency_sensitivity": [{"scale": scale, "steps": steps_json(projection.with_latency_scale(scale), lengths)}
                                for scale in (*LATENCY_SCALES, 0.0)]}})


def dcn_json(phase: PhaseTime) -> dict:
    """What of a phase crosses the DCN: per call (per token for a decode), and once around a decode loop."""
    dcn = phase.cost.dcn if phase.cost else NO_COLLECTIVES
    setup = phase.cost.setup_dcn if phase.cost else NO_COLLECTIVES
    return {"dcn_collective_mb_per_device": dcn.total_bytes / 1e6, "dcn_collectives": dcn.total,
            "setup_dcn_collective_mb_per_device": setup.total_bytes / 1e6, "setup_dcn_collectives": setup.total}
