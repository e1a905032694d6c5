"""The bad-input catalogue of the newer inputs (tasks, tools, the teacher, estimators, policy losses,
and settings the chosen configuration does not read): like tests/e2e/test_bad_inputs.py, each case
goes through `grpo-run` in process and must exit 2 before any model is built, with exactly one
stderr line naming the problem and the fix, no traceback, and nothing written."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from grpo_core.config_io import config_to_yaml, load_config
from grpo_core.config_unused import UnusedSettingWarning
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.hf_io import export_pretrained
from grpo_core.registry import default_registry
from grpo_core.tokenizer import CALCULATOR_CALL_TOKENS, TOOL_CALL_TOKENS, build_char_tokenizer
from grpo_runner_gsm8k.cli import main

REPO = Path(__file__).resolve().parents[2]
TOOLS = str(REPO / "configs" / "tiny_tools.yaml")  # multi-turn on, with a tool-token tokenizer
# a teacher with the char tokenizer whose context (16 positions) is shorter than the tiny rows (16 + 1)
SHORT_TEACHER = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16,
                 "tie_word_embeddings": True}
TEACHER = "teacher.path={tmp}/short_teacher"


@dataclass(frozen=True)
class Bad:
    """One bad input: `args` follow the base config ('{tmp}' is the scratch directory of the test)."""

    id: str
    args: tuple[str, ...]
    problem: str  # a piece of the message naming the key and value
    fix: str  # a piece of the message saying what to do
    base: str | None = None  # a config file instead of configs/tiny.yaml


CATALOGUE = [
    # ---- tasks: options that cannot make a problem, templates naming unknown fields
    Bad("arithmetic-template-unknown-field", ("task.options.template='{expression}{foo}='",),
        "task.options: template = '{expression}{foo}=' names the unknown field {foo}", "the fields are {expression}"),
    Bad("arithmetic-template-positional-field", ("task.options.template='{0}={expression}'",),
        "names the unknown field {0}", "write a literal brace as {{ or }}"),
    Bad("arithmetic-template-unclosed-brace", ("task.options.template='{expression}{='",),
        "template = '{expression}{=' is not a format text", "write a literal brace as {{ or }}"),
    Bad("arithmetic-template-without-expression", ("task.options.template='What is it?'",),
        "template = 'What is it?' lacks {expression}", "add {expression} to template"),
    Bad("arithmetic-empty-result-range", ("task.options.max_result=0", "task.options.digits=9",
                                          "task.options.operands=8"),
        "arithmetic task options give no problem with a result in range (allow_negative=False, max_result=0)",
        "raise task.options.max_result, set task.options.allow_negative=true"),
    Bad("countdown-template-unknown-field", ("task.name=countdown", "task.options={template: '{numbers} {goal}'}"),
        "template = '{numbers} {goal}' names the unknown field {goal}", "the fields are {numbers}, {target}"),
    Bad("countdown-template-without-target", ("task.name=countdown", "task.options={template: 'Use {numbers}.'}"),
        "template = 'Use {numbers}.' lacks {target}", "add {target} to template"),
    Bad("countdown-empty-target-range", ("task.name=countdown", "task.options={max_target: 1, max_number: 1000, count: 6}"),
        "countdown task options give no whole target in 1..1 in 1000 draws of 6 numbers up to 1000",
        "raise task.options.max_target"),
    Bad("gsm8k-path-pattern-unknown-field", ("task.name=gsm8k", "task.options={path: '{tmp}/{split}-{part}.jsonl'}"),
        "-{part}.jsonl' names the unknown field {part}", "the fields are {split}"),
    Bad("boxed-path-pattern-unknown-field", ("task.name=math500", "task.options={path: '{tmp}/boxed/{splt}.jsonl'}"),
        "names the unknown field {splt}", "the fields are {split}"),
    Bad("boxed-problem-field-unknown", ("task.name=math500", "task.options={path: '{tmp}/boxed/test.jsonl', "
                                        "problem_field: question}"),
        "boxed/test.jsonl line 1 has no field 'question'", "set task.options.problem_field"),
    Bad("boxed-breakdown-field-unknown", ("task.name=math500", "task.options={path: '{tmp}/boxed/test.jsonl', "
                                          "breakdown_fields: [levle]}"),
        "task.options.breakdown_fields names 'levle', which no row of", "name fields the rows have"),
    # ---- tools
    Bad("tools-while-multi-turn-off", ("rollout.multi_turn.tools=[calculator]",),
        "rollout.multi_turn.tools = ['calculator'] is not used: rollout.multi_turn.enabled is false",
        "set rollout.multi_turn.enabled=true, or remove rollout.multi_turn.tools"),
    Bad("misspelt-tool-while-multi-turn-off", ("rollout.multi_turn.tools=[calculater]",),
        "rollout.multi_turn.tools = ['calculater'] is not used", "set rollout.multi_turn.enabled=true"),
    Bad("tool-options-while-multi-turn-off", ("rollout.multi_turn.tool_options={python: {}}",),
        "rollout.multi_turn.tool_options = {'python': {}} is not used", "set rollout.multi_turn.enabled=true"),
    Bad("max-turns-while-multi-turn-off", ("rollout.multi_turn.max_turns=2",),
        "rollout.multi_turn.max_turns = 2 is not used", "remove rollout.multi_turn.max_turns"),
    Bad("environment-while-multi-turn-off", ("rollout.multi_turn.environment=guess",),
        "rollout.multi_turn.environment = 'guess' is not used", "set rollout.multi_turn.enabled=true"),
    Bad("tool-offered-twice", ("rollout.multi_turn.tools=[calculator, calculator]",),
        "offers 'calculator' more than once", "list each tool once", base=TOOLS),
    Bad("tool-option-typo", ("rollout.multi_turn.tool_options={python: {wall_second: 2}}",
                             "rollout.multi_turn.tools=[calculator, python]"),
        "unknown config key rollout.multi_turn.tool_options.python.wall_second",
        "did you mean rollout.multi_turn.tool_options.python.wall_seconds?", base=TOOLS),
    Bad("tool-not-a-name", ("rollout.multi_turn.tools=[7]",), "rollout.multi_turn.tools: unknown tool '7'",
        "available: calculator, python", base=TOOLS),
    # ---- the teacher
    Bad("teacher-context-shorter-than-rows", (TEACHER,),
        "rollout.max_prompt_length + rollout.max_new_tokens = 16 + 1 = 17 exceeds the teacher's "
        "max_position_embeddings 16", "use a teacher with a longer context"),
    Bad("teacher-context-shorter-than-multi-turn-rows", ("teacher.path={tmp}/tools_teacher",),
        "rollout.max_prompt_length + rollout.multi_turn.max_total_tokens = 32 + 64 = 96 exceeds the teacher's "
        "max_position_embeddings 80", "lower rollout.multi_turn.max_total_tokens", base=TOOLS),
    Bad("teacher-tokenizer-differs", (TEACHER,), "the teacher's tokenizer differs from the student's first at id",
        "use a teacher with the student's tokenizer", base=TOOLS),
    Bad("teacher-options-without-teacher", ("teacher.placement=replicated",), "teacher section without teacher.path",
        "set teacher.path to the teacher's HF model directory"),
    Bad("teacher-forward-kl-sampled", (TEACHER, "teacher.divergence=forward"),
        "teacher.divergence = 'forward' with teacher.estimator = 'sampled'", "set teacher.estimator=full"),
    Bad("teacher-baseline-with-full-kl", (TEACHER, "teacher.estimator=full", "teacher.baseline=leave_one_out"),
        "teacher.baseline = 'leave_one_out' with teacher.estimator = 'full'", "set teacher.baseline=none"),
    # ---- estimators
    Bad("scale-rewards-with-rloo", ("loss.advantage_estimator=rloo", "loss.scale_rewards=batch"),
        "loss.scale_rewards = 'batch' is not used: loss.advantage_estimator = 'rloo'", "set loss.advantage_estimator=grpo"),
    Bad("scale-rewards-with-gdpo", ("loss.advantage_estimator=gdpo", "task.rewards={correctness: 1.0, format: 0.5}",
                                    "loss.scale_rewards=none"),
        "loss.scale_rewards = 'none' is not used", "or remove loss.scale_rewards"),
    Bad("options-of-an-estimator-without-options", ("loss.advantage_options={batch_norm: false}",),
        "unknown config key loss.advantage_options.batch_norm", "it takes no options"),
    Bad("reinforce-baseline-with-groups-of-one", ("loss.advantage_estimator=reinforce_pp_baseline", "rollout.n=1"),
        "reinforce_pp_baseline needs at least two samples per prompt", "set rollout.n >= 2"),
    Bad("gdpo-std-ddof-beyond-group", ("loss.advantage_estimator=gdpo", "task.rewards={correctness: 1.0, format: 0.5}",
                                       "rollout.n=2", "loss.std_ddof=2", "rollout.prompts_per_step=8"),
        "gdpo normalises each reward function by its group std (loss.std_ddof = 2)", "set rollout.n >= 3"),
    # ---- policy losses: options of another loss
    Bad("cispo-cap-with-clip", ("loss.cispo_epsilon_max=3",),
        "loss.cispo_epsilon_max = 3.0 is not used: loss.policy_loss = 'clip'", "set loss.policy_loss=cispo"),
    Bad("sapo-temperature-with-clip", ("loss.sapo_temperature_pos=2",),
        "loss.sapo_temperature_pos = 2.0 is not used", "set loss.policy_loss=sapo"),
    Bad("sapo-temperature-with-cispo", ("loss.policy_loss=cispo", "loss.sapo_temperature_neg=2"),
        "loss.sapo_temperature_neg = 2.0 is not used: loss.policy_loss = 'cispo'", "set loss.policy_loss=sapo"),
    Bad("clip-higher-with-cispo", ("loss.policy_loss=cispo", "loss.epsilon_high=0.28"),
        "loss.epsilon_high = 0.28 is not used: loss.policy_loss = 'cispo'", "set loss.policy_loss=clip"),
    Bad("clip-lower-with-sapo", ("loss.policy_loss=sapo", "loss.epsilon_low=0.1"),
        "loss.epsilon_low = 0.1 is not used: loss.policy_loss = 'sapo'", "set loss.policy_loss=clip"),
    Bad("cispo-cap-below-one", ("loss.policy_loss=cispo", "loss.cispo_epsilon_max=0.5"),
        "loss.cispo_epsilon_max = 0.5 is out of range", "must be >= 1.0"),
    Bad("dual-clip-with-sapo", ("loss.policy_loss=sapo", "loss.epsilon_c=3"),
        "loss.epsilon_c = 3.0 is the dual clip of the clipped surrogate", "set loss.epsilon_c=null"),
    # ---- other settings the configuration does not read
    Bad("kl-estimator-without-beta", ("loss.kl_estimator=k1",), "loss.kl_estimator = 'k1' is not used: loss.beta = 0",
        "set loss.beta > 0"),
    Bad("kl-weighting-without-beta", ("loss.kl_importance_weighted=true",), "loss.kl_importance_weighted = True is "
        "not used", "set loss.beta > 0"),
    Bad("mismatch-threshold-without-correction", ("loss.mismatch_c_max=3",),
        "loss.mismatch_c_max = 3.0 is not used: loss.mismatch_correction = 'none'", "set loss.mismatch_correction=truncate"),
    Bad("mismatch-level-without-correction", ("loss.mismatch_level=sequence",), "loss.mismatch_level = 'sequence' is "
        "not used", "set loss.mismatch_correction=truncate"),
    Bad("extra-rollouts-without-refill", ("loss.dynamic_sampling=true", "loss.max_extra_rollouts=2"),
        "loss.max_extra_rollouts = 2 is not used", "loss.dynamic_sampling_mode=refill"),
    Bad("moments-with-sgd", ("train.optimizer=sgd", "train.b2=0.9"), "train.b2 = 0.9 is not used: train.optimizer = 'sgd'",
        "set train.optimizer=adamw"),
    Bad("min-lr-with-constant-schedule", ("train.min_lr_ratio=0.5",),
        "train.min_lr_ratio = 0.5 is not used: train.schedule = 'constant'", "set train.schedule=cosine"),
    Bad("partial-cache-while-partial-off", ("rollout.partial.kv_cache=reprefill",),
        "rollout.partial.kv_cache = 'reprefill' is not used", "set rollout.partial.enabled=true"),
    # ---- k of pass@k / maj@k
    Bad("fractional-k", ("eval.n=4", "eval.k=[2.5]"), "eval.k holds 2.5: each k must be an integer in 1..eval.n = 4",
        "give whole numbers of samples"),
    Bad("k-beyond-n", ("eval.n=2", "eval.k=[4]"), "eval.k holds 4", "or raise eval.n"),
]


def _boxed_rows() -> str:
    rows = [{"problem": "What is 1 + 1?", "answer": "2", "unique_id": "a", "level": 1},
            {"problem": "What is 2 + 2?", "answer": "4", "unique_id": "b", "level": 2}]
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """Short-context teachers (of the tiny config's tokenizer and of tiny_tools', exported once) and a
    two-row boxed-math file."""
    root = tmp_path_factory.mktemp("newer")
    _export(root / "short_teacher", SHORT_TEACHER, build_char_tokenizer())
    tools_tokenizer = build_char_tokenizer(extra_special_tokens=(*TOOL_CALL_TOKENS, *CALCULATOR_CALL_TOKENS))
    _export(root / "tools_teacher", {**SHORT_TEACHER, "max_position_embeddings": 80}, tools_tokenizer)
    (root / "boxed").mkdir()
    (root / "boxed" / "test.jsonl").write_text(_boxed_rows())
    return root


def _export(out: Path, architecture: dict, tokenizer) -> None:
    qcfg = QwenConfig.from_hf_dict({**architecture, "vocab_size": len(tokenizer), "torch_dtype": "float32"})
    export_pretrained(init_from_config(qcfg, seed=1, dtype="float32"), out, tokenizer)


def _argv(case: Bad, tmp: Path, one_step: Callable[..., list[str]]) -> list[str]:
    args = [arg.replace("{tmp}", str(tmp)) for arg in case.args]
    return one_step(tmp / "run", *args, config=case.base)


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_newer_bad_input_exits_2_with_one_line_and_writes_nothing(case, scratch, one_step, capsys, monkeypatch):
    monkeypatch.setattr("grpo_runner_gsm8k.assembly.build.load_or_init_model", _no_model)
    before = _files(scratch)
    assert main(_argv(case, scratch, one_step)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("grpo-run: error: "), lines[0]
    assert case.problem in lines[0] and case.fix in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert _files(scratch) == before
    assert not (scratch / "run").exists()


def _no_model(*args, **kwargs):
    raise AssertionError("a bad input reached the model load: it must be refused before any model is built")


def test_the_catalogue_holds_35_distinct_inputs():
    assert len({c.id for c in CATALOGUE}) == len(CATALOGUE) >= 35
    assert len({(c.base, c.args) for c in CATALOGUE}) == len(CATALOGUE)


PRESETS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_and_its_printed_config_load(preset, tmp_path):
    """The unused-key rule refuses no preset, and a printed (or saved) config loads back the same."""
    cfg = load_config(preset, [f"logging.dir={tmp_path}"], registry=default_registry())
    printed = tmp_path / "printed.yaml"
    printed.write_text(config_to_yaml(cfg))
    assert load_config(printed, registry=default_registry()) == cfg
    assert yaml.safe_load(printed.read_text())["rollout"]["multi_turn"]["enabled"] == cfg.rollout.multi_turn.enabled


# The two settings the loader fills in from rollout.max_new_tokens are warned about, not refused: a
# saved config carries the filled value, and it must load back with another rollout.max_new_tokens.
@pytest.mark.parametrize("setting, line", [
    ("loss.max_completion_length=3", "loss.max_completion_length = 3 is not used: loss.aggregation = 'token_mean' "
     "has no fixed length; set loss.aggregation=fixed_length_norm"),
    ("rollout.partial.budget=2", "rollout.partial.budget = 2 is not used: rollout.partial.enabled is false; set "
     "rollout.partial.enabled=true"),
], ids=["max-completion-length", "partial-budget"])
def test_an_unused_filled_in_setting_is_one_warning_line(setting, line, tiny_config_path, tmp_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", f"logging.dir={tmp_path / 'run'}", setting]) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo-run: warning: ")]
    assert len(warned) == 1 and line in warned[0], warned


def test_a_saved_config_loads_back_with_another_max_new_tokens(tiny_config_path, tmp_path):
    saved = tmp_path / "saved.yaml"
    saved.write_text(config_to_yaml(load_config(tiny_config_path, [f"logging.dir={tmp_path}"])))
    with pytest.warns(UnusedSettingWarning, match="loss.max_completion_length = 1 is not used"):
        cfg = load_config(saved, ["rollout.max_new_tokens=4"])
    assert cfg.rollout.max_new_tokens == 4
