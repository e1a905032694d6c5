"""`grpo-run --plan --target SLICE`: the TPU compiler (libtpu, compile-only devices) plans
for a TPU slice from this CPU host; slice names map to the devices and hosts a real
slice has; bad names and configs too large for the chip's HBM are one-line errors."""

from __future__ import annotations

import json
import math
import os
import re

import jax
import pytest
from grpo_core.errors import UserError
from grpo_core.registry import default_registry
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.costs import tpu_target
from grpo_runner_gsm8k.cli import main

pytest.importorskip("libtpu")

# ~17B float32 params: their shards alone exceed a v5e chip's 16 GiB over 4 chips.
HUGE = ["model.architecture.hidden_size=8192", "model.architecture.intermediate_size=32768",
        "model.architecture.num_hidden_layers=16"]


@pytest.mark.parametrize("name, devices, hosts, kind", [
    ("v6e-8", 8, 1, "TPU v6 lite"),    # one host of 8 chips
    ("v6e-16", 16, 4, "TPU v6 lite"),  # 4 hosts of 2x2 chips
    ("v4-16", 8, 2, "TPU v4"),         # 16 TensorCores = 8 megacore chips on 2 hosts
    ("v5e-4", 4, 1, "TPU v5 lite"),
    ("v5p-8", 4, 1, "TPU v5"),
    ("v6e:4x4", 16, 4, "TPU v6 lite"),
])
def test_slices_have_the_devices_and_hosts_of_a_real_slice(name, devices, hosts, kind):
    found = tpu_target.target_devices(tpu_target.parse_target(name))
    assert len(found) == devices
    assert len({d.process_index for d in found}) == hosts
    assert {d.device_kind for d in found} == {kind}


def test_slice_shapes_follow_cloud_tpu():
    shapes = {name: tpu_target.parse_target(name).topology for name in ("v6e-8", "v6e-128", "v4-8", "v4-256")}
    assert shapes == {"v6e-8": (2, 4), "v6e-128": (8, 16), "v4-8": (2, 2, 1), "v4-256": (4, 4, 8)}


@pytest.mark.parametrize("gather", ["auto", "false"])
def test_tiny_model_planned_by_the_tpu_compiler(plan_config, tmp_path, capsys, gather):
    cfg = plan_config(f"rollout.options.gather_weights={gather}")
    environment = dict(os.environ)
    assert plan.plan_command(cfg, default_registry(), target="v5e-4", expect_tokens=3) == 0
    assert dict(os.environ) == environment  # libtpu's variables and the CPU scheduler flag are scoped to the plan
    out = capsys.readouterr().out
    assert "projected time per device: a lower bound from the TPU compiler's programs, not a measurement (v5e: " \
           "197 TFLOP/s bf16, 819 GB/s HBM, 400 GB/s ICI per chip" in out
    assert re.search(r"^projected step at 8 completion tokens per row: .*\(7 decode steps x .*completion tokens/s$",
                     out, re.M)
    assert re.search(r"^projected step at 3 completion tokens per row: .*\(2 decode steps x ", out, re.M)
    assert "5 us per collective (derived: " in out
    assert re.search(r"^collective latency sensitivity, step at 8 / 3 tokens .*: 0\.5x [\d.]+ s / [\d.]+ s, "
                     r"1x .*, 2x .*; none [\d.]+ s / [\d.]+ s$", out, re.M)
    [line] = [x for x in out.splitlines() if x.startswith('{"projection"')]
    assert [s["completion_tokens"] for s in json.loads(line)["projection"]["steps"]] == [8, 3]
    assert "on 4 TPU v5 lite device(s)" in out
    assert "figures: the TPU compiler's (libtpu) for v5e-4 (TPU v5 lite, topology v5e:2x2): 4 devices on 1 host" in out
    decode_line = {  # auto: the four layouts projected for the chip; false: FSDP weights gathered every token
        "auto": r"^  rollout decode: gather_weights=auto: \w+ weights, the fastest projected decode of 7 steps "
                r"\(gathered [\d.]+ s, sharded [\d.]+ s, model_parallel [\d.]+ s, head_parallel [\d.]+ s\); "
                r"collectives per decoded token: ",
        "false": r"^  rollout decode: collectives per decoded token: .*all-gather [\d.]+ MiB"}[gather]
    assert re.search(decode_line, out, re.M), out
    assert re.search(r"^peak: [\d.]+ GiB per device \(\w[\w -]+\) of 15\.75 GiB \(v5e usable HBM of 16 GiB: the "
                     r"bytes_limit a v5e chip reports; cloud\.google\.com", out, re.M)
    assert {"rollout prefill", "rollout decode", "train step"} <= {line[:18].strip() for line in out.splitlines()}
    assert not (tmp_path / "run").exists()


def test_too_large_for_the_chip_exits_3_naming_phase_and_margin(tiny_config_path, plan_overrides, tmp_path, capsys):
    assert main(["--config", tiny_config_path, *plan_overrides, *HUGE, f"logging.dir={tmp_path / 'run'}", "--plan",
                 "--target", "v5e-4"]) == plan.EXIT_DOES_NOT_FIT
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo-run:")]
    match = re.match(r"grpo-run: does not fit: (rollout prefill|rollout decode|train step) needs ([\d.]+) GiB per "
                     r"device, exceeds HBM by ([\d.]+) GiB \(capacity 15\.75 GiB\)", line)
    assert match, line
    assert float(match.group(2)) - 15.75 == pytest.approx(float(match.group(3)), abs=0.011)


@pytest.mark.parametrize("name", ["v7x-8", "v6e-12", "v6e:4x4x4", "tpu"])
def test_bad_target_is_one_line_listing_valid_ones(tiny_config_path, name, tmp_path, capsys):
    assert main(["--config", tiny_config_path, f"logging.dir={tmp_path / 'run'}", "--plan", "--target", name]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"grpo-run: error: --target {name!r}: ")
    assert "v6e-{1,4,8,16,32,64,128,256}" in line and "v4-{8,16,32" in line and "'v6e:4x4'" in line


def test_without_libtpu_target_says_how_to_install(monkeypatch):
    monkeypatch.setattr(tpu_target.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"--target needs the TPU compiler \(libtpu\), which is not installed; .*"
                                        r"grpo-runner-gsm8k\[tpu\]"):
        tpu_target.target_devices(tpu_target.parse_target("v5e-4"))


def test_target_without_plan_is_refused(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--target", "v6e-8"]) == 2
    assert "--target only applies to --plan" in capsys.readouterr().err


def test_pallas_loss_is_lowered_through_mosaic_for_the_target(plan_config, tmp_path):
    """The plan for TPU devices lowers the pallas loss as Mosaic kernels (per device, in
    shard_map), not the interpreter the CPU host would pick."""
    cfg = plan_config("loss.impl=pallas")
    inputs = plan.build_plan_inputs(cfg, default_registry(), plan.parse_target("v5e-4"))
    lower, args = plan.update_lowering(inputs, cfg.train.micro_batch_size_per_device)
    assert lower(*args).as_text().count("tpu_custom_call") >= 3  # stats, d_h and d_w kernels
    assert plan.train_phase(inputs, cfg.train.micro_batch_size_per_device).total > 0  # and the TPU compiler compiles them


def test_a_block_shape_the_tpu_cannot_tile_is_one_line_naming_the_option(tiny_config_path, plan_overrides, tmp_path,
                                                                          capsys):
    args = ["--config", tiny_config_path, "--plan", "--target", "v5e-4", *plan_overrides,
            f"logging.dir={tmp_path / 'run'}",
            "loss.impl=pallas", "model.dtype=bfloat16", "loss.options.time_block=8"]
    assert main(args) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo-run: error: pallas loss: block (8, ")
    assert "set loss.options.time_block to a multiple of 16" in line


# Wide enough that the layer kernels dominate; several micro-batches, scanned layers, full remat.
STACKED = ["model.architecture.hidden_size=512", "model.architecture.intermediate_size=2048",
           "model.architecture.num_attention_heads=8", "model.architecture.num_key_value_heads=2",
           "model.architecture.num_hidden_layers=3", "model.architecture.max_position_embeddings=128",
           "model.dtype=bfloat16", "model.param_dtype=float32", "model.remat=full",
           "rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=64",
           "train.micro_batch_size_per_device=2"]


def test_tpu_compiler_keeps_no_compute_dtype_copy_of_the_layer_stack(tiny_config):
    """Each layer casts its own float32 kernels to bfloat16 inside the layer loop; the TPU
    compiler would otherwise hoist one cast of the whole stack out of the loops and hold it
    all step (on the 3B v6e-8 preset 0.98 GiB of train-step temp). Looks for a bfloat16
    value shaped [layers, ...] with as many elements as a stacked kernel's shard."""
    cfg = tiny_config(*STACKED)
    inputs = plan.build_plan_inputs(cfg, default_registry(), tpu_target.parse_target("v6e-8"))
    layers = cfg.model.architecture["num_hidden_layers"]
    kernel_sizes = {math.prod(leaf.sharding.shard_shape(leaf.shape))
                    for path, leaf in jax.tree_util.tree_leaves_with_path(inputs.params)
                    if "kernel" in jax.tree_util.keystr(path) and leaf.shape[0] == layers}
    text = plan.compile_update(inputs).as_text()
    stack_copies = [m.group(0) for m in re.finditer(rf"= bf16\[{layers},([\d,]+)\]", text)
                    if layers * math.prod(int(d) for d in m.group(1).split(",")) in kernel_sizes]
    assert len(kernel_sizes) == 3 and not stack_copies, stack_copies  # q/o, k/v and MLP shard sizes


@pytest.mark.parametrize("name, peak, hbm, ici, usable", [
    ("v4-8", 275, 1200, 600, 32.0), ("v5e-4", 197, 819, 400, 15.75), ("v5p-8", 459, 2765, 1200, 95.0),
    ("v6e-8", 918, 1638, 800, 31.25)])
def test_chip_table_is_cloud_tpus_published_figures(name, peak, hbm, ici, usable):
    chip = tpu_target.parse_target(name).generation
    assert (chip.peak_tflops, chip.hbm_gbps, chip.ici_gbps) == (peak, hbm, ici)
    assert chip.usable_hbm_gib == pytest.approx(usable, abs=0.01) and chip.usable_hbm_gib <= chip.hbm_gib


def test_plan_target_verdict_uses_usable_hbm_and_the_flags_override_it():
    target = tpu_target.parse_target("v6e-8")
    assert plan.device_capacity(None, target).gib == 31.25
    assert plan.device_capacity(None, tpu_target.with_chip(target, "usable_hbm_gib=20")).source.startswith(
        "v6e usable HBM of 32 GiB: --chip")
    assert plan.device_capacity(12.0, target).gib == 12.0
    assert tpu_target.with_chip(target, "peak_tflops=900, hbm_gbps=1500").generation.hbm_gbps == 1500


@pytest.mark.parametrize("text", ["peak=900", "hbm_gbps=-1", "ici_gbps=fast", "collective_latency_us=-1"])
def test_bad_chip_override_is_one_line_naming_the_fields(text):
    with pytest.raises(UserError, match=rf"^--chip '{re.escape(text)}': give name=value with a value > 0, names: "
                                        r"peak_tflops, hbm_gbps, ici_gbps, usable_hbm_gib, collective_latency_us, "
                                        r"dcn_host_gbps, dcn_latency_us \(collective_latency_us and dcn_latency_us "
                                        r"may be 0\)$"):
        tpu_target.with_chip(tpu_target.parse_target("v6e-8"), text)


@pytest.mark.parametrize("flag, why", [(["--expect-completion-tokens", "9"], "must be between 1 and rollout.max_new_tokens (8)"),
                                       (["--chip", "hbm=1"], "give name=value with a value > 0")])
def test_bad_projection_flags_are_one_line(tiny_config_path, plan_overrides, tmp_path, capsys, flag, why):
    args = ["--config", tiny_config_path, *plan_overrides, f"logging.dir={tmp_path / 'run'}", "--plan", "--target",
            "v5e-4", *flag]
    assert main(args) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo-run: error: ") and why in line


def test_projection_flags_without_target_are_refused(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--plan", "--expect-completion-tokens", "4"]) == 2
    assert "--expect-completion-tokens only applies to --plan --target SLICE" in capsys.readouterr().err


@pytest.mark.parametrize("name, devices, hosts", [("2xv6e-8", 16, 2), ("v6e-8x2", 16, 2), ("v5p-128x2", 128, 32)])
def test_multislice_targets_have_every_slices_devices_and_hosts(name, devices, hosts):
    target = tpu_target.parse_target(name)
    found = tpu_target.target_devices(target)
    assert (target.slices, len(found), len({d.process_index for d in found})) == (2, devices, hosts)
    assert sorted({d.slice_index for d in found}) == [0, 1]


def test_a_multislice_mesh_is_jaxs_hybrid_mesh_with_one_slice_per_half_of_dp():
    from grpo_core.config import MeshConfig
    from grpo_meshes import resolve_strategy
    from jax.experimental import mesh_utils

    devices = tpu_target.target_devices(tpu_target.parse_target("2xv6e-8"))
    grid = resolve_strategy(MeshConfig(slices=2)).device_grid(devices)
    assert grid.shape == (2, 8, 1)
    assert [{d.slice_index for d in grid[i].flat} for i in range(2)] == [{0}, {1}]
    hybrid = mesh_utils.create_hybrid_device_mesh((1, 8, 1), (2, 1, 1), devices, allow_split_physical_axes=True)
    assert grid.tolist() == hybrid.tolist()


def test_a_multislice_target_needs_as_many_mesh_slices(plan_config):
    with pytest.raises(UserError, match=r"mesh.slices=1 but the 16 devices are on 2 slice\(s\).*set mesh.slices=2"):
        plan.plan_command(plan_config(), default_registry(), target="2xv6e-8")


def test_tiny_model_planned_across_two_slices_sends_only_gradient_all_reduces(plan_config):
    """The TPU compiler's multislice program: each slice's own SPMD program, and what crosses the DCN as
    transfers to its megascale runtime: none per decoded token, all-reduces (the gradients) in the update."""
    from grpo_runner_gsm8k.costs.memory import PhaseMemory
    from grpo_runner_gsm8k.plan.projection import project, projection_json, projection_lines

    cfg = plan_config("mesh.slices=2", "rollout.options.gather_weights=true")
    target = tpu_target.parse_target("2xv6e-8")
    inputs = plan.build_plan_inputs(cfg, default_registry(), target)
    assert "(TPU v6 lite, 2 slices of topology v6e:2x4): 16 devices on 2 host(s)" in inputs.target
    programs = {**plan.compile_rollout(inputs), "train step": plan.compile_update(inputs)}
    assert set(re.findall(r'_xla_megascale_transfer_type="(\w+)"', programs["train step"].as_text())) == {"ALL_REDUCE"}
    phases = [PhaseMemory.from_compiled(name, compiled) for name, compiled in programs.items()]
    projection = project(inputs, target.generation, phases)
    out = "\n".join(projection_lines(projection, [8]))
    assert re.search(r"^across the 2 slices \(DCN: 3\.125 GB/s per chip = 25 GB/s per host \(not published: .*"
                     r"rollout decode: none per token.*; train step: [\d.]+ MB in \d+ collective\(s\)", out, re.M)
    report = json.loads(projection_json(projection, [8]))["projection"]["phases"]
    assert report["rollout decode"]["dcn_collectives"] == 0 and report["train step"]["dcn_collectives"] > 0


@pytest.mark.parametrize(("layout", "sharding"), [("model_parallel", "legacy"), ("model_parallel", "maxtext"),
                                                  ("head_parallel", "legacy")])
def test_split_decodes_across_two_slices_send_nothing_between_them_per_token(plan_config, layout, sharding):
    """The model- and head-parallel decodes split the weights within each slice (the layout's
    (slice, ...) mesh of the hybrid mesh's devices), so neither the reshard before the loop nor a
    decoded token crosses the DCN: the program's one transfer is the loop's test that every row is
    done, in a branch its condition takes every 16 tokens. The prefill of the 8 shared prompts (on 16
    devices) splits them over the slices: nothing crosses there either. With the batch split over dp
    alone (maxtext), the model-parallel weights split over the devices that copy a slice's rows."""
    from grpo_core.hlo import HloModule
    from grpo_runner_gsm8k.costs.roofline import data_dependent_loop

    cfg = plan_config("mesh.slices=2", f"rollout.options.gather_weights={layout}", f"rollout.sharding={sharding}")
    inputs = plan.build_plan_inputs(cfg, default_registry(), tpu_target.parse_target("2xv6e-8"))
    programs = plan.compile_rollout(inputs)
    assert HloModule(programs["rollout prefill"].as_text()).dcn_transfers() == (0, 0)  # each slice its 4 prompts
    module = HloModule(programs["rollout decode"].as_text())
    loop = data_dependent_loop(module)
    condition = re.search(r"condition=%([\w.\-]+)", loop.attrs).group(1)
    [gate] = [inst for inst in module.computations[condition].instructions if inst.op == "conditional"]
    assert module.dcn_transfers(loop.body())[1] == 0
    assert sum(module.collective_count(loop.body()).values()) > 0  # split weights: reduced within the slice
    assert module.dcn_transfers()[1] == module.dcn_transfers(condition)[1] == 1
    assert sum(module.dcn_transfers(branch)[1] for branch in gate.callees()) == 1
