"""Property-based fuzzing of what a user hands `grpo-run`: config files, override lists and
GSM8K-style JSONL data. Whatever the input, the answer is exit 0 or exit 2 with one
`grpo-run: error:` line, never a traceback (exit 1), and a rejected config writes nothing.

The config properties go through `cli.main(["--config", F, "--print-config", ...])`: the
loading and every check a run makes before device work, in process (a subprocess per
example would cost seconds). A few real CLI subprocesses close the loop. Example counts
are bounded and derandomized so CI time is fixed and failures reproduce.
"""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_core.config import RunConfig
from grpo_core.config_io import section_type
from grpo_core.errors import UserError
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.assembly.build import from_plugin
from grpo_runner_gsm8k.cli import main

CONFIG_EXAMPLES, OVERRIDE_EXAMPLES, JSONL_EXAMPLES = 120, 120, 80


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a fuzzed model.path never reaches the network

SECTIONS = [f.name for f in dataclasses.fields(RunConfig)]
PATHS = [(name, f.name) for name in SECTIONS for f in dataclasses.fields(section_type([name]))]
KEYS = sorted({key for _, key in PATHS})

EDGES = st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, 10**400, -(10**400), 1e308, -0.0, float("nan"),
                         float("inf"), True, None, "~", "~/x", "null", "1e-3", "yes", "on", "<<", "fused", "jax",
                         "char", "auto", "", "é∂ƒ", "\x00", "a" * 300])
scalars = st.one_of(  # edge values weigh as much as all the rest
    EDGES, st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20)))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner,
                                                 max_size=3)), max_leaves=6)
names = st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=10))
sections = st.one_of(st.sampled_from(SECTIONS), st.text(min_size=1, max_size=10))
# mostly real (section, key) pairs, so values reach the type and range checks
paths = st.one_of(st.sampled_from(PATHS), st.sampled_from(PATHS), st.sampled_from(PATHS), st.tuples(sections, names))


@st.composite
def config_edits(draw) -> list[tuple]:
    """A few (kind, section, key, value) edits of a config: keys set, sections replaced or dropped."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        (section, key), kind = draw(paths), draw(st.sampled_from(["set", "set", "section", "drop"]))
        edits.append((kind, section, key, None if kind == "drop" else draw(values)))
    return edits


def edited(tree: dict, edits: list[tuple]) -> dict:
    for kind, section, key, value in edits:
        if kind == "set":
            target = tree.setdefault(section, {})
            if isinstance(target, dict):
                target[key] = value
        elif kind == "section":
            tree[section] = value
        else:
            tree.pop(section, None)
    return tree


overrides = st.one_of(
    st.builds(lambda p, v: f"{p[0]}.{p[1]}={v}", paths, st.text(max_size=15)),
    st.builds(lambda s, v: f"{s}={v}", sections, st.sampled_from(["{}", "null", "~", "{n: 4}", "[1]", "3", "{n: x}"])),
    st.builds(lambda p, v: f"{p[0]}.{p[1]}={json.dumps(v)}", paths, scalars),
    st.text(max_size=25))


def check_answer(code: int, err: str, run_dir: Path) -> None:
    assert code in (0, 2), err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("grpo-run: error: "), err
        assert not run_dir.exists(), f"a rejected config wrote {sorted(run_dir.rglob('*'))}"


@fuzz(CONFIG_EXAMPLES)
@given(edits=config_edits(), text_instead=st.one_of(st.none(), st.text(max_size=60)))
def test_fuzzed_config_files_exit_0_or_2_in_one_line(edits, text_instead, tiny_config_path, tmp_path_factory, capsys):
    tree = edited(yaml.safe_load(Path(tiny_config_path).read_text()), edits)
    folder = tmp_path_factory.mktemp("cfg")
    config = folder / "run.yaml"
    try:
        text = text_instead if text_instead is not None else yaml.safe_dump(tree, allow_unicode=True)
    except yaml.YAMLError:
        text = "{"
    config.write_text(text, encoding="utf-8", errors="surrogatepass")
    run_dir = folder / "run"
    code = main(["--config", str(config), "--print-config", f"logging.dir={run_dir}"])
    check_answer(code, capsys.readouterr().err, run_dir)


@fuzz(OVERRIDE_EXAMPLES)
@given(items=st.lists(overrides, min_size=1, max_size=3))
def test_fuzzed_override_lists_exit_0_or_2_in_one_line(items, tiny_config_path, tmp_path_factory, capsys):
    run_dir = tmp_path_factory.mktemp("ovr") / "run"
    argv = ["--config", tiny_config_path, "--print-config", *items, f"logging.dir={run_dir}"]
    if any(item.startswith("-") for item in items):  # flags: argparse answers those (usage error, exit 2)
        argv = ["--config", tiny_config_path, "--print-config", "--", *items, f"logging.dir={run_dir}"]
    code = main(argv)
    check_answer(code, capsys.readouterr().err, run_dir)


@pytest.mark.parametrize("args", [
    ["rollout.n=~"], ["rollout=null"], ["train.seed=18446744073709551616"], ["train.lr=1e400"],
    ["rollout={n: 4}", "train.steps=1", "rollout.prompts_per_step=4", "eval.every_steps=0"],
])
def test_real_cli_subprocess_answers_in_one_line(args, tmp_path, grpo_cli):
    run_dir = tmp_path / "run"
    done = grpo_cli.run(grpo_cli.train_argv(*args, f"logging.dir={run_dir}"), timeout=300)
    assert done.returncode in (0, 2), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    if done.returncode == 2:
        assert done.stderr.strip().count("\n") == 0 and not run_dir.exists()


# ---- GSM8K-style JSONL ----------------------------------------------------------------------------
good_row = st.fixed_dictionaries({"question": st.text(max_size=30),
                                  "answer": st.builds(lambda s, n: f"{s}\n#### {n}", st.text(max_size=20),
                                                      st.integers(-10**6, 10**6))})
odd_row = st.one_of(
    good_row, st.dictionaries(st.sampled_from(["question", "answer", "x"]), values, max_size=3),
    st.fixed_dictionaries({"question": st.text(max_size=5), "answer": st.text(max_size=5000)}), values)
lines = st.one_of(
    odd_row.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.binary(max_size=20), st.just(b""), st.just(b"{\"question\": \"q\", \"answer\": \"#### 1\"} trailing"),
    st.builds(lambda r, b: json.dumps(r).encode()[:-1] + b + b"}", good_row, st.sampled_from([b"\xff", b"\xc3"])))


def first_bad_byte(data: bytes) -> int | None:
    """Offset of the first byte of `data` that is not UTF-8 (an independent scan per line)."""
    offset = 0
    for line in data.split(b"\n"):  # the loader splits on newlines only
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return offset + exc.start
        offset += len(line) + 1
    return None


@fuzz(JSONL_EXAMPLES)
@given(rows=st.lists(lines, min_size=1, max_size=6))
def test_fuzzed_gsm8k_lines_load_or_fail_in_one_line(rows, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gsm8k")
    data = b"\n".join(row.replace(b"\n", b" ").replace(b"\r", b" ") for row in rows) + b"\n"
    (folder / "train.jsonl").write_bytes(data)
    (folder / "test.jsonl").write_bytes(b'{"question": "q", "answer": "#### 1"}\n')
    try:
        task = from_plugin(default_registry(), "task", "gsm8k", {"path": str(folder)}, "task.options")
    except UserError as exc:
        message = str(exc)
        assert "\n" not in message.strip()
        bad = first_bad_byte(data)
        if bad is not None:  # the first problem in the file is an undecodable byte
            line = data[:bad].count(b"\n") + 1
            if f"train.jsonl:{line}:" in message:
                assert f"byte {bad} (0x{data[bad]:02x})" in message, message
            else:  # an earlier line failed first, for another reason
                assert int(message.split("train.jsonl:")[1].split()[0].rstrip(":")) < line, message
        return
    assert task.train and all(ex.answer for ex in task.train)
