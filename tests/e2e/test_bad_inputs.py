"""The bad-input catalogue: every case goes through `grpo-run` end to end and must exit 2 with
exactly one stderr line that names the problem and the fix, no traceback, and nothing written."""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from grpo_core import NoOptions, RewardSpec, hookimpl
from grpo_core.testing import registry_with
from grpo_runner_gsm8k.cli import main

MODEL_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 128, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


@dataclass(frozen=True)
class Bad:
    """One bad input: `args` follow the config ('{tmp}' is the scratch directory of the test)."""

    id: str
    args: tuple[str, ...]
    problem: str  # a piece of the message naming what is wrong
    fix: str  # a piece of the message saying what to do
    config: str | None = None  # YAML text used instead of configs/tiny.yaml


CATALOGUE = [
    # ---- the config file and the command line
    Bad("malformed-yaml", (), "is not valid YAML at line 3: mapping values are not allowed here", "fix the syntax",
        config="train:\n  lr: 1e-3\n  steps: 3: 4\n"),
    Bad("yaml-not-a-mapping", (), "must hold a mapping of sections, got list", "as top-level keys", config="- a\n- b\n"),
    Bad("typo-key-in-file", (), "unknown config key train.stpes", "did you mean train.steps?",
        config="train:\n  stpes: 3\n"),
    Bad("missing-config-file", ("--config", "{tmp}/absent.yaml"), "absent.yaml' not found",
        "pass an existing YAML file to --config"),
    Bad("typo-section", ("rolout.n=4",), "unknown config key rolout", "did you mean rollout?"),
    Bad("typo-key", ("loss.epsilon_hgih=0.3",), "unknown config key loss.epsilon_hgih", "did you mean loss.epsilon_high?"),
    Bad("override-without-value", ("train.lr",), "override 'train.lr' is not of the form section.key=value",
        "example: train.lr=1e-6"),
    Bad("unknown-flag", ("--confg", "x.yaml"), "unrecognized arguments: --confg", "see grpo-run --help"),
    Bad("wrong-type-number", ("train.lr=fast",), "train.lr = 'fast' has the wrong type", "expected a finite number"),
    Bad("wrong-type-integer", ("rollout.n=2.5",), "rollout.n = 2.5 has the wrong type", "expected an integer"),
    Bad("wrong-choice", ("model.dtype=float16",), "model.dtype = 'float16' has the wrong type",
        "expected one of 'float32', 'bfloat16'"),
    Bad("yaml11-boolean-word", ("mesh.distributed=yes",), "mesh.distributed = 'yes' has the wrong type",
        "expected one of 'auto', 'on', 'off'"),
    Bad("zero-prompts", ("rollout.prompts_per_step=0",), "rollout.prompts_per_step = 0 is out of range", "must be >= 1"),
    Bad("negative-new-tokens", ("rollout.max_new_tokens=-5",), "rollout.max_new_tokens = -5 is out of range",
        "must be >= 1"),
    Bad("negative-lr", ("train.lr=-1e-3",), "train.lr = -0.001 is out of range", "must be > 0.0"),
    Bad("k1-with-group-std", ("rollout.n=1",), "rollout.n = 1 with loss.scale_rewards = 'group'",
        "set rollout.n >= 2 or loss.scale_rewards=none"),
    # ---- advantage estimators
    Bad("rloo-with-groups-of-one", ("loss.advantage_estimator=rloo", "rollout.n=1"),
        "loss.advantage_estimator = 'rloo': rollout.n = 1: rloo needs at least one other sample", "set rollout.n >= 2"),
    Bad("gdpo-with-one-reward", ("loss.advantage_estimator=gdpo",),
        "task.rewards weights 1 (correctness); with one reward function gdpo equals grpo",
        "set loss.advantage_estimator=grpo or add a reward function"),
    Bad("unknown-estimator", ("loss.advantage_estimator=rlo",), "loss.advantage_estimator: unknown advantage 'rlo'",
        "available: gdpo, grpo, reinforce_pp_baseline, rloo"),
    Bad("estimator-option-typo", ("loss.advantage_estimator=gdpo", "task.rewards={correctness: 1.0, format: 0.5}",
                                  "loss.advantage_options={batch_nrom: false}"),
        "unknown config key loss.advantage_options.batch_nrom", "did you mean loss.advantage_options.batch_norm?"),
    Bad("no-rewards", ("task.rewards={}",), "task.rewards is empty", "name at least one reward function"),
    Bad("options-for-unused-reward", ("task.reward_options={format: {}}",),
        "task.reward_options.format configures a reward that task.rewards does not use", "add it to task.rewards"),
    Bad("eval-reward-not-trained-on", ("eval.reward=format",),
        "eval.reward = 'format' is not one of task.rewards (correctness)", "weight 0 judges answers"),
    # ---- plugin names and options
    Bad("unknown-loss", ("loss.impl=fusd",), "loss.impl: unknown loss 'fusd'", "Did you mean 'fused'?"),
    Bad("unknown-mesh", ("mesh.strategy=fsdp_pt",), "mesh.strategy: unknown mesh 'fsdp_pt'", "available: auto"),
    Bad("unknown-task", ("task.name=gsm9k",), "task.name: unknown task 'gsm9k'", "Did you mean 'gsm8k'?"),
    Bad("unknown-reward", ("task.rewards={corectness: 1.0}",), "task.rewards: unknown reward 'corectness'",
        "Did you mean 'correctness'?"),
    Bad("unknown-rollout", ("rollout.backend=vllm",), "rollout.backend: unknown rollout 'vllm'", "available: jax"),
    Bad("task-option-typo", ("task.options.digit=2",), "unknown config key task.options.digit",
        "did you mean task.options.digits?"),
    Bad("task-option-range", ("task.options.digits=0",), "task.options.digits = 0 is out of range", "must be >= 1"),
    Bad("options-of-another-task", ("task.name=gsm8k",), "unknown config key task.options.digits",
        "valid keys: hub_config"),
    # ---- the mesh against the devices (8 fake CPU devices) and the model
    Bad("batch-not-divisible-by-devices", ("rollout.prompts_per_step=3", "rollout.n=3"),
        "rollout batch of 9 rows is not divisible by dp*fsdp*tp = 8", "the nearest being 8 or 16"),
    Bad("mesh-product-mismatch", ("mesh.strategy=2,2,3",), "mesh shape 2,2,3 (dp*fsdp*tp = 12) does not match the 8 devices",
        "try '1,-1,1'"),
    Bad("mesh-fixed-axes-do-not-divide", ("mesh.strategy=1,-1,3",), "the fixed axes multiply to 3, which does not divide 8",
        "try '1,-1,1'"),
    Bad("tp-not-dividing-heads", ("mesh.strategy=1,1,8",), "tp=8 does not divide num_attention_heads=4",
        "use tp in [1, 2]"),
    Bad("tp-not-dividing-kv-heads", ("mesh.strategy=1,2,4",), "tp=4 does not divide num_key_value_heads=2",
        "use tp in [1, 2]"),
    Bad("maxtext-batch-not-divisible-by-dp", ("mesh.strategy=8,1,1", "rollout.sharding=maxtext",
                                              "rollout.prompts_per_step=3", "rollout.n=2"),
        "rollout batch of 6 rows is not divisible by dp = 8", "use a multiple of 8"),
    Bad("micro-batch-not-dividing", ("train.micro_batch_size_per_device=3",),
        "micro-batches of 24 rows, which do not divide the 16 rows of a step", "pick a per-device size that divides it"),
    Bad("process-count-not-met", ("mesh.require_process_count=2",),
        "only 1 of the 2 processes required by mesh.require_process_count joined", "launch it on every host"),
    Bad("heads-not-multiple-of-kv-heads", ("model.architecture.num_attention_heads=3",),
        "num_attention_heads=3 must be a multiple of num_key_value_heads=2", "must be a multiple"),
    Bad("unsupported-model-type", ("model.architecture.model_type=gemma2",), "model_type='gemma2' is not supported",
        "supported: gemma3_text | llama | qwen2 | qwen3 | qwen3_moe (the installed model families)"),
    Bad("vocab-smaller-than-tokenizer", ("model.architecture.vocab_size=10",),
        "the tokenizer has 100 tokens but the model's vocab_size is 10", "raise model.architecture.vocab_size"),
    Bad("max-new-tokens-beyond-positions", ("rollout.max_new_tokens=100",),
        "rollout.max_prompt_length + rollout.max_new_tokens = 16 + 100 = 116 exceeds the model's "
        "max_position_embeddings 64", "lower rollout.max_new_tokens"),
    Bad("eval-new-tokens-beyond-positions", ("eval.max_new_tokens=60",),
        "rollout.max_prompt_length + eval.max_new_tokens = 16 + 60 = 76 exceeds", "lower eval.max_new_tokens"),
    Bad("prompt-longer-than-max-prompt-length", ("rollout.max_prompt_length=2",),
        "prompt of example 'arithmetic/train/0' has 4 tokens, more than rollout.max_prompt_length=2",
        "raise rollout.max_prompt_length"),
    # ---- files: model, tokenizer, data, run directory
    Bad("missing-model-dir", ("model.path=/nonexistent", "model.tokenizer=char"),
        "model.path: '/nonexistent' is not a model directory", "point model.path at an HF model directory"),
    Bad("missing-model-dir-as-tokenizer", ("model.path=/nonexistent", "model.tokenizer=null"), "model.path '/nonexistent' is not a directory",
        "set model.tokenizer=char"),
    Bad("model-dir-without-config", ("model.path={tmp}/empty_model", "model.tokenizer=char"),
        "empty_model/config.json not found", "point model.path at an HF model directory"),
    Bad("corrupt-safetensors", ("model.path={tmp}/corrupt_model", "model.tokenizer=char"),
        "cannot read safetensors file", "re-download or re-export the checkpoint"),
    Bad("missing-tokenizer", ("model.tokenizer=/nonexistent",), "model.tokenizer '/nonexistent' is not a directory",
        "point model.tokenizer at a directory holding tokenizer files"),
    Bad("missing-dataset", ("task.name=gsm8k", "task.options={path: /nonexistent}"),
        "gsm8k path '/nonexistent' is not a directory", "give a directory with train.jsonl"),
    Bad("missing-dataset-split-file", ("task.name=gsm8k", "task.options={path: '/nonexistent/{split}.jsonl'}"),
        "/nonexistent/train.jsonl does not exist", "check task.options.path"),
    Bad("dataset-line-not-json", ("task.name=gsm8k", "task.options={path: {tmp}/bad_data}"),
        "bad_data/train.jsonl:2 is not valid JSON", "at byte 63 of the file); fix or remove the line"),
    Bad("dataset-prompt-too-long", ("task.name=gsm8k", "task.options={path: {tmp}/long_data}"),
        "prompt of example 'gsm8k/train/0' has", "raise rollout.max_prompt_length"),
    # ---- issue 17: inputs that used to give a traceback, or were silently accepted
    Bad("empty-run-dir", ("logging.dir=''",), "logging.dir = '' is empty", "set it to the run directory"),
    Bad("fused-block-size-zero", ("loss.options.block_size=0",), "loss.options: fused loss option block_size",
        "must be a positive int, got 0"),
    Bad("pallas-block-size-not-lane-multiple", ("loss.impl=pallas", "loss.options.block_size=100"),
        "loss.options: pallas loss option block_size", "multiple of 128"),
    Bad("rollout-trim-bucket-zero", ("rollout.options.trim_bucket=0",), "rollout.options: trim_bucket=0",
        "must be >= 1"),
    Bad("rollout-cache-dtype-float16", ("rollout.options.cache_dtype=float16",),
        "rollout.options: cache_dtype='float16' is not supported", "use null, float32 or bfloat16"),
    Bad("rollout-prompt-buckets-empty", ("rollout.options.prompt_buckets=[]",), "rollout.options: prompt_buckets=[]",
        "must be non-empty"),
    Bad("plugin-option-error-under-print-config", ("--print-config", "loss.options.block_size=0"),
        "loss.options: fused loss option block_size", "must be a positive int, got 0"),
    Bad("print-config-checks-positions", ("--print-config", "rollout.max_new_tokens=100"),
        "exceeds the model's max_position_embeddings 64", "lower rollout.max_new_tokens"),
    Bad("print-config-checks-prompts", ("--print-config", "rollout.max_prompt_length=2"),
        "has 4 tokens, more than rollout.max_prompt_length=2", "raise rollout.max_prompt_length"),
    Bad("architecture-typo", ("model.architecture.num_hiden_layers=8",),
        "unknown config key model.architecture.num_hiden_layers", "did you mean model.architecture.num_hidden_layers?"),
    Bad("duplicate-key", (), "duplicate key 'steps' at lines 2 and 3", "keep one of them",
        config="train:\n  steps: 3\n  steps: 4\n"),
    Bad("duplicate-section", (), "duplicate key 'train' at lines 1 and 3", "merge duplicated sections into one",
        config="train:\n  steps: 3\ntrain:\n  lr: 1.0e-3\n"),
    Bad("empty-config-file", (), "config.yaml' is empty", "leave out --config to run the embedded defaults",
        config="# nothing yet\n"),
    Bad("non-utf8-config", ("--config", "{tmp}/latin1.yaml"), "latin1.yaml' is not UTF-8 text", "save it as UTF-8"),
    Bad("infinite-lr", ("train.lr=.inf",), "train.lr = inf has the wrong type", "expected a finite number"),
    Bad("nan-grad-norm", ("train.max_grad_norm=.nan",), "train.max_grad_norm = nan has the wrong type",
        "a finite number"),
    Bad("nan-reward-weight", ("task.rewards={correctness: .nan}",), "task.rewards.correctness = nan",
        "expected a finite number"),
    Bad("huge-temperature", ("rollout.temperature=1e39",), "rollout.temperature = 1e+39 is out of range",
        "must be > 0.0 and <= 100.0"),
    Bad("dataset-question-not-a-string", ("task.name=gsm8k", "task.options={path: {tmp}/int_question}"),
        "gsm8k train row 0: 'question' is int 7, not a string", "fix or remove the row"),
    Bad("dataset-row-not-an-object", ("task.name=gsm8k", "task.options={path: {tmp}/list_row}"),
        "gsm8k train row 1 is a list, not an object", "fix or remove the row"),
    Bad("dataset-answer-without-number", ("task.name=gsm8k", "task.options={path: {tmp}/no_number}"),
        "gsm8k train row 0: GSM8K answer '' after '####' is not a number", "must end in '#### <number>'"),
    Bad("dataset-late-prompt-too-long", ("task.name=gsm8k", "task.options={path: {tmp}/late_long, instruction: ''}",
                                          "rollout.max_prompt_length=40"),
        "prompt of example 'gsm8k/train/7' has", "raise rollout.max_prompt_length"),
    # ---- the memory plan
    Bad("plan-unknown-sweep-field", ("--plan", "--sweep", "train.lr"), "--sweep 'train.lr' is not supported",
        "supported: micro_batch_size_per_device"),
    Bad("plan-zero-capacity", ("--plan", "--capacity-gib", "0"), "--capacity-gib 0.0 must be > 0",
        "give the per-device memory in GiB"),
    Bad("plan-unknown-hub-architecture", ("--plan", "model.path=Org/Unknown-Model", "model.tokenizer=char"),
        "architecture is not built in", "download the model's config.json into a directory"),
    # ---- issue 26: sizes, seeds, data bytes and config edge cases
    Bad("seed-beyond-32-bits", ("train.seed=4294967296",), "train.seed = 4294967296 is out of range",
        "must be >= 0 and <= 4294967295"),
    Bad("model-seed-beyond-32-bits", ("model.seed=18446744073709551616",), "model.seed = 18446744073709551616",
        "<= 4294967295"),
    Bad("number-beyond-float-range", ("train.lr=" + "9" * 400,), "train.lr = 999", "expected a finite number"),
    Bad("section-overridden-with-null", ("rollout=null",), "override rollout=null: rollout is a section",
        "set its keys (rollout.<key>=value) or give a mapping"),
    Bad("section-overridden-with-scalar", ("train=3",), "override train=3: train is a section", "give a mapping"),
    Bad("lone-surrogate-text", ('task.system_prompt="\\ud800"',), "task.system_prompt = '\\ud800' holds a lone "
        "surrogate", "write the character itself"),
    Bad("dataset-line-not-utf8", ("task.name=gsm8k", "task.options={path: {tmp}/latin1_data}"),
        "latin1_data/train.jsonl:2: byte 79 (0xe9) is not UTF-8 text", "save the file as UTF-8"),
    Bad("merge-key-onto-unknown-key", (), "unknown config key rollout.bogus", "valid keys",
        config="model: {tokenizer: char}\nrollout:\n  <<: {n: 4, bogus: 1}\n"),
    Bad("run-dir-under-a-file", ("logging.dir={tmp}/file/run",), "is a file", "choose another logging.dir"),
    Bad("run-dir-is-a-file", ("logging.dir={tmp}/file",), "cannot be used as a directory: it is a file",
        "choose another logging.dir"),
    # ---- multi-turn rollouts
    Bad("multi-turn-unknown-tool", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculater]"),
        "rollout.multi_turn.tools: unknown tool 'calculater'", "calculator"),
    Bad("multi-turn-no-tools", ("rollout.multi_turn.enabled=true",), "rollout.multi_turn.tools = []",
        "offer at least one tool"),
    Bad("multi-turn-zero-turns", ("rollout.multi_turn.max_turns=0",), "rollout.multi_turn.max_turns = 0 is out of "
        "range", "must be >= 1"),
    Bad("multi-turn-partial-on-a-kept-cache", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]",
                                               "rollout.partial.enabled=true", "loss.mismatch_correction=truncate",
                                               "rollout.multi_turn.kv_cache=kept"),
        "carried conversations continue by re-prefill", "set rollout.multi_turn.kv_cache=auto"),
    Bad("multi-turn-partial-with-staleness", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]",
                                              "rollout.partial.enabled=true", "loss.mismatch_correction=truncate",
                                              "rollout.partial.max_staleness=3"),
        "rollout.partial.max_staleness = 3 with rollout.multi_turn.enabled", "set rollout.partial.max_staleness=null"),
    Bad("multi-turn-without-chat-template", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"),
        "with task.options.use_chat_template = false", "set task.options.use_chat_template=true"),
    Bad("multi-turn-without-tool-tokens", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]",
                                           "task.options={digits: 1, operations: '+', use_chat_template: true}",
                                           "rollout.max_prompt_length=40"),
        "the tokenizer encodes '</tool_call>' as 12 tokens", "model.tokenizer=char-tools"),
    Bad("multi-turn-unknown-environment", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=guess"),
        "rollout.multi_turn.environment: unknown environment 'guess'", "available"),
    Bad("multi-turn-environment-options-alone", ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]",
                                                 "rollout.multi_turn.environment_options={max_guesses: 2}"),
        "rollout.multi_turn.environment_options is set but rollout.multi_turn.environment is null",
        "name the environment or remove its options"),
]


def _gsm8k_rows(question: str) -> str:
    return json.dumps({"question": question, "answer": "2 + 2 = 4\n#### 4"}) + "\n"


@pytest.fixture
def scratch(tmp_path) -> Path:
    """The files the catalogue points at: a regular file, broken model dirs, broken datasets."""
    (tmp_path / "file").write_text("not a directory\n")
    (tmp_path / "empty_model").mkdir()
    corrupt = tmp_path / "corrupt_model"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(json.dumps(MODEL_CONFIG))
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header" * 4)
    (tmp_path / "latin1.yaml").write_bytes("train:\n  steps: 3  # pr\u00e9cis\n".encode("latin-1"))
    (tmp_path / "latin1_data").mkdir()
    latin1_row = json.dumps({"question": "Caf\u00e9?", "answer": "#### 4"}, ensure_ascii=False)
    (tmp_path / "latin1_data" / "train.jsonl").write_bytes(
        _gsm8k_rows("What is 2 + 2?").encode() + (latin1_row + "\n").encode("latin-1"))
    (tmp_path / "latin1_data" / "test.jsonl").write_text(_gsm8k_rows("What is 1 + 3?"))
    for name, train in [("bad_data", _gsm8k_rows("What is 2 + 2?") + "{not json\n"),
                        ("long_data", _gsm8k_rows("What is 2 + 2? " * 20)),
                        ("int_question", json.dumps({"question": 7, "answer": "#### 7"}) + "\n"),
                        ("list_row", _gsm8k_rows("What is 2 + 2?") + "[1, 2]\n"),
                        ("no_number", json.dumps({"question": "What?", "answer": "so\n#### "}) + "\n"),
                        ("late_long", _gsm8k_rows("What is 2 + 2?") * 7 + _gsm8k_rows("What is 2 + 2? " * 20))]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text(train)
        (tmp_path / name / "test.jsonl").write_text(_gsm8k_rows("What is 1 + 3?"))
    return tmp_path


def _argv(case: Bad, tmp: Path, one_step: Callable[..., list[str]]) -> list[str]:
    config = None
    if case.config is not None:
        config = str(tmp / "config.yaml")
        Path(config).write_text(case.config)
    args = [arg.replace("{tmp}", str(tmp)) for arg in case.args]
    return one_step(tmp / "run", *args, config=config, eval_every=None)  # eval on: some cases are about it


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _assert_one_line(err: str, case: Bad) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("grpo-run: error: "), lines[0]
    assert case.problem in lines[0] and case.fix in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, scratch, one_step, capsys):
    argv = _argv(case, scratch, one_step)
    before = _files(scratch)
    assert main(argv) == 2
    captured = capsys.readouterr()
    _assert_one_line(captured.err, case)
    assert captured.out == ""
    assert _files(scratch) == before
    assert not (scratch / "run").exists()


def test_the_catalogue_holds_25_distinct_inputs():
    assert len({c.id for c in CATALOGUE}) == len(CATALOGUE) >= 25
    assert len({(c.config, c.args) for c in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories; the file cases cover it")
def test_read_only_parent_of_the_run_dir(tmp_path, one_step, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(one_step(locked / "run")) == 2
        _assert_one_line(capsys.readouterr().err, Bad("read-only", (), "is not writable", "choose a writable logging.dir"))
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


# The console script itself: what a user sees in a terminal.
CONSOLE_CASES = [c for c in CATALOGUE if c.id in ("malformed-yaml", "corrupt-safetensors", "unknown-flag")] + [
    # jax.distributed is initialised at most once per process, so this one only runs in a subprocess
    Bad("distributed-on-without-coordinator", ("mesh.distributed=on",),
        "jax.distributed.initialize failed (mesh.distributed is 'on'; coordinator_address=None",
        "set mesh.coordinator_address"),
]


@pytest.mark.parametrize("case", CONSOLE_CASES, ids=[c.id for c in CONSOLE_CASES])
def test_console_prints_one_line_and_exits_2(case, scratch, one_step, grpo_cli):
    before = _files(scratch)
    proc = grpo_cli.run(grpo_cli.argv(*_argv(case, scratch, one_step)), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _assert_one_line(proc.stderr, case)
    assert proc.stdout == ""
    assert _files(scratch) - before <= {scratch / "config.yaml"}
    assert not (scratch / "run").exists()


# ---- resuming: the refusals that need a checkpoint are in tests/e2e/test_resume.py, on the run it trains
def test_resume_without_a_checkpoint_exits_2(tmp_path, one_step, capsys):
    pytest.importorskip("grpo_runner_gsm8k.operations.checkpoint")
    case = Bad("resume-without-checkpoint", (), f"--resume: no complete checkpoint in {tmp_path / 'run'}",
               "run without --resume to start")
    assert main(one_step(tmp_path / "run", "--resume")) == 2
    _assert_one_line(capsys.readouterr().err, case)
    assert list(tmp_path.iterdir()) == []


class RaisingReward:
    """A third-party reward whose factory fails on its input (a missing resource, say)."""

    @staticmethod
    def _build(options):
        raise RuntimeError("vocabulary file 'units.txt' not found")

    @hookimpl
    def grpo_rewards(self):
        return [RewardSpec("units", self._build, NoOptions, "Fails when built")]


@pytest.mark.parametrize("flags", [(), ("--print-config",)], ids=["run", "print-config"])
def test_reward_factory_that_raises_is_one_line(flags, scratch, one_step, capsys, monkeypatch):
    registry = registry_with(RaisingReward())
    monkeypatch.setattr("grpo_core.registry.default_registry", lambda: registry)
    case = Bad("reward-factory-raises", (), "task.reward_options.units of reward 'units': vocabulary file "
               "'units.txt' not found", "fix the options or the plugin's inputs")
    argv = one_step(scratch / "run", "task.rewards={correctness: 1.0, units: 0.5}", *flags)
    assert main(argv) == 2
    captured = capsys.readouterr()
    _assert_one_line(captured.err, case)
    assert captured.out == "" and not (scratch / "run").exists()


def test_report_out_that_is_not_a_png_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train-reward/total/mean": 0.5}) + "\n")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "x.txt")]) == 2
    _assert_one_line(capsys.readouterr().err, Bad("report-out-not-png", (), "x.txt'", "give a path ending in .png"))
    assert not (tmp_path / "x.txt").exists()
