"""The distillation teacher (`teacher:`): config errors and a teacher with another tokenizer are
one line and exit 2; `--plan` counts the teacher's params and its scoring phase; a short run
through the real loop scores with the teacher, also for a LoRA student whose reference is its base."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.hf_io import abstract_model, export_pretrained
from grpo_core.registry import default_registry
from grpo_core.tokenizer import DEFAULT_CHARS, build_char_tokenizer
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.assembly.teacher import TEACHER_PHASE

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True}
SMALLER = {**TINY, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1}


def export_tiny(out: Path, architecture: dict, seed: int, tokenizer=None) -> Path:
    """A random-init model of `architecture` and its tokenizer (default: the char tokenizer) as an HF directory."""
    tokenizer = tokenizer or build_char_tokenizer()
    qcfg = QwenConfig.from_hf_dict({**architecture, "vocab_size": len(tokenizer), "torch_dtype": "float32"})
    export_pretrained(init_from_config(qcfg, seed=seed, dtype="float32"), out, tokenizer)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """student: the tiny config's architecture; teacher: a smaller one, another init; swapped: the
    smaller one with a tokenizer whose first two characters trade ids."""
    root = tmp_path_factory.mktemp("models")
    swapped = build_char_tokenizer(DEFAULT_CHARS[1] + DEFAULT_CHARS[0] + DEFAULT_CHARS[2:])
    return {"student": export_tiny(root / "student", TINY, 0), "teacher": export_tiny(root / "teacher", SMALLER, 1),
            "swapped": export_tiny(root / "swapped", SMALLER, 1, swapped)}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-run: error: "), err
    return err[0]


BAD_SECTIONS = ["teacher:\n  coef: 0.5\n", "teacher: {}\n", "teacher:\n", "teacher:\n  path: null\n  dtype: bfloat16\n"]


@pytest.mark.parametrize("text", BAD_SECTIONS, ids=["coef-only", "empty", "null", "null-path"])
def test_a_teacher_section_without_a_path_exits_2(tiny_config_path, tmp_path, capsys, text):
    config = tmp_path / "teacher.yaml"
    config.write_text(Path(tiny_config_path).read_text() + text)
    assert main(["--config", str(config), "--print-config"]) == 2
    assert "teacher section without teacher.path" in one_error_line(capsys)


def test_an_override_of_a_teacher_setting_without_a_path_exits_2(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", "teacher.coef=0.5"]) == 2
    assert "set teacher.path" in one_error_line(capsys)


def test_the_printed_config_of_a_run_without_teacher_loads_back(tiny_config_path, tmp_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["teacher"]["path"] is None
    (tmp_path / "printed.yaml").write_text(printed)
    assert main(["--config", str(tmp_path / "printed.yaml"), "--print-config"]) == 0


@pytest.mark.parametrize("overrides,hint", [
    (["loss.dynamic_sampling=true"], "set loss.dynamic_sampling=false or teacher.use_task_reward=true"),
    (["teacher.coef=0"], "teacher.coef = 0.0 is out of range: must be > 0.0"),
    (["teacher.placement=everywhere"], "teacher.placement"),
    (["teacher.baseline=leave_one_out", "rollout.n=1"], "set rollout.n >= 2 or teacher.baseline=none"),
    (["teacher.estimator=full", "teacher.baseline=leave_one_out"],
     "teacher.baseline = 'leave_one_out' with teacher.estimator = 'full': the exact KL has no sampling variance"),
    (["teacher.estimator=exact"], "teacher.estimator"),
    (["teacher.divergence=forward"], "the sampled estimate is of the reverse KL only; set teacher.estimator=full"),
], ids=["dynamic-sampling-alone", "coef-zero", "placement", "baseline-without-group", "baseline-with-full",
        "unknown-estimator", "forward-with-sampled"])
def test_bad_teacher_settings_exit_2(tiny_config_path, models, capsys, overrides, hint):
    argv = ["--config", tiny_config_path, "--print-config", f"teacher.path={models['teacher']}", *overrides]
    assert main(argv) == 2
    assert hint in one_error_line(capsys)


def test_a_missing_teacher_directory_exits_2(tiny_config_path, tmp_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", f"teacher.path={tmp_path / 'absent'}"]) == 2
    assert "teacher.path" in one_error_line(capsys)


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_first_differing_id(tiny_config_path, models, capsys):
    assert main(["--config", tiny_config_path, "--print-config", f"teacher.path={models['swapped']}"]) == 2
    first = build_char_tokenizer().convert_tokens_to_ids(DEFAULT_CHARS[0])
    line = one_error_line(capsys)
    assert (f"differs from the student's first at id {first} (student {DEFAULT_CHARS[0]!r}, "
            f"teacher {DEFAULT_CHARS[1]!r})") in line, line


def test_print_config_fills_the_teacher_dtype(tiny_config_path, models, capsys):
    argv = ["--config", tiny_config_path, "--print-config", f"teacher.path={models['teacher']}", "model.dtype=bfloat16"]
    assert main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out)["teacher"]["dtype"] == "bfloat16"


def teacher_param_count() -> int:
    q = QwenConfig.from_hf_dict({**SMALLER, "vocab_size": len(build_char_tokenizer())})
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract_model(q, "float32"))))


@pytest.mark.parametrize("placement,estimator", [("sharded", "sampled"), ("replicated", "sampled"), ("sharded", "full")])
def test_plan_counts_the_teacher_and_compiles_its_scoring(plan_config, models, placement, estimator):
    from grpo_runner_gsm8k import plan
    from grpo_runner_gsm8k.plan.phases import teacher_phase, update_lowering

    cfg = plan_config(f"teacher.path={models['teacher']}", f"teacher.placement={placement}",
                      f"teacher.estimator={estimator}")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    whole = 4 * teacher_param_count()  # float32
    if placement == "replicated":
        assert inputs.teacher_bytes == whole
    else:  # split over the 8 devices, less what the rules leave whole (norms, biases)
        assert whole / 8 <= inputs.teacher_bytes < whole / 2
    phase = teacher_phase(inputs)
    assert phase.name == TEACHER_PHASE and phase.arguments >= inputs.teacher_bytes
    assert inputs.held_beside_rollout >= inputs.teacher_bytes
    if estimator == "full":  # the update takes the teacher's states and head: it lowers with them
        lower, args = update_lowering(inputs, 1)
        assert args[2].teacher_hidden.shape[-1] == SMALLER["hidden_size"] and args[2].teacher_head is not None
        lower(*args)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run_two_steps(tiny_config, small_run, tmp_path):
    """`run_two_steps(*overrides)`: the metrics of 2 small steps of the tiny config through the real loop."""
    from grpo_runner_gsm8k.loop import Trainer, build_run

    def run(*overrides: str) -> list[dict]:
        cfg = tiny_config(*small_run(2), "rollout.max_new_tokens=4", *overrides)
        Trainer(build_run(cfg, default_registry())).run()
        return records(tmp_path / "run")

    return run


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_starts_at_zero_reverse_kl(run_two_steps, models):
    """Step 1 samples with the teacher's own weights: the sampler's log-probs and the teacher's scores
    of the same tokens differ only by float32 rounding (decode vs full forward: ~1e-6)."""
    steps = run_two_steps(f"model.path={models['student']}", f"teacher.path={models['student']}")
    assert abs(steps[0]["train-other/distill_reverse_kl"]) < 1e-5
    assert math.isfinite(steps[1]["train-other/distill_reverse_kl"]) and steps[1]["train-other/skipped_steps"] == 0


@pytest.mark.slow
def test_a_lora_student_keeps_its_base_as_reference_and_distills_from_the_teacher(run_two_steps, models):
    """At step 1 the adapters are 0: the policy equals its base (the reference), so the KL metric is 0,
    while the teacher, another model, disagrees with it."""
    steps = run_two_steps(f"model.path={models['student']}", f"teacher.path={models['teacher']}",
                          "model.lora.rank=4", "loss.beta=0.05", "teacher.use_task_reward=true")
    assert abs(steps[0]["train-other/kl"]) < 1e-6
    assert abs(steps[0]["train-other/distill_reverse_kl"]) > 1e-3  # a sample estimate, of either sign
    assert all(s["train-other/skipped_steps"] == 0 for s in steps)


@pytest.mark.slow
def test_a_lora_student_distills_with_the_exact_kl(run_two_steps, models):
    """teacher.estimator full through the real loop: the teacher's states and head reach the update
    of a LoRA student, whose exact KL to another model is positive and falls over two steps."""
    steps = run_two_steps(f"model.path={models['student']}", f"teacher.path={models['teacher']}",
                          "model.lora.rank=4", "teacher.estimator=full", "train.lr=0.01")
    kls = [s["train-other/distill_full_kl"] for s in steps]
    assert kls[0] > 1e-3 and kls[1] < kls[0], kls
    assert all(s["train-other/skipped_steps"] == 0 for s in steps)


def test_a_checkpoint_saved_before_the_teacher_section_resumes_without_a_teacher(tiny_config):
    from grpo_core.config_io import config_to_dict
    from grpo_runner_gsm8k.operations.checkpoint import Resume
    from grpo_runner_gsm8k.operations.resume_config import check_compatible

    cfg = tiny_config()
    saved = config_to_dict(cfg)
    del saved["teacher"]
    resume = Resume(Path(cfg.logging.dir), [1], saved, {})
    check_compatible(config_to_dict(resume.run_config), config_to_dict(cfg), resume.where)
    with pytest.raises(Exception, match="teacher.path"):  # adding a teacher on resume changes the math
        check_compatible(config_to_dict(resume.run_config), config_to_dict(dataclasses.replace(
            cfg, teacher=dataclasses.replace(cfg.teacher, path="/t", dtype="float32"))), resume.where)
