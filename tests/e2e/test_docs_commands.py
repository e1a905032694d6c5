"""Every `grpo-run` / `grpo-bench` command that README.md and the manual (docs/) show still runs as
shown: its subcommand exists, each of its flags is in that subcommand's --help, and where it names
a config file of the repository, the file exists and its overrides load."""

import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from grpo_core.config_io import load_config
from grpo_core.errors import ConfigError
from grpo_core.registry import default_registry

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = {"grpo-run": {"plugins", "export", "report", "launch", "eval"},
            "grpo-bench": {"model", "loss", "rollout", "flops", "gpu"}}
COMMAND = re.compile(r"(?:^|\s)(?P<command>(?:grpo-run|grpo-bench)(?:\s.*)?)$")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")


def shown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def commands_in(text: str) -> list[str]:
    """Commands in fenced blocks (continuation lines joined) and in inline code spans."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            found += _command(line)
    for span in SPAN.findall(FENCE.sub("", text)):
        found += _command(" ".join(span.split()))
    return found


def _command(text: str) -> list[str]:
    """The command in `text` (inside a quoted remote command: up to the quote). `grpo-bench
    {model,loss,...}` and `grpo-bench <name>` name a family of commands, not one."""
    match = COMMAND.search(re.split(r"\s#\s", text)[0])  # a shell comment after the command is prose
    if not match or re.match(r"\S+ [{<]", match["command"]):
        return []
    command = match["command"].strip()
    try:
        shlex.split(command)
    except ValueError:  # the closing quote of the remote command it sits in
        command = command.split('"')[0].strip()
    return [command]


def shown_commands() -> list[tuple[str, str]]:
    return [(page.name, command) for page in shown_pages() for command in commands_in(page.read_text())]


def split(command: str) -> tuple[str, str | None, list[str]]:
    """(program, subcommand or None, the rest), optional parts' brackets taken off."""
    program, *rest = shlex.split(command.replace("[", " ").replace("]", " "))
    if rest and rest[0] in PROGRAMS[program]:
        return program, rest[0], rest[1:]
    return program, None, rest


# One process prints every --help the pages need: one start-up (jax imports) instead of one per command.
HELP_SCRIPT = """
import contextlib, io, json, sys
from grpo_core.bench import main as bench
from grpo_runner_gsm8k.cli import main as run
texts = {}
for program, subcommand in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            (run if program == "grpo-run" else bench)([*([subcommand] if subcommand else []), "--help"])
        except SystemExit:
            pass
    texts[f"{program} {subcommand}"] = out.getvalue()
print(json.dumps(texts))
"""


@cache
def help_texts() -> dict[str, str]:
    """`<program> <subcommand or None>` -> what its --help printed, for every command the pages show."""
    wanted = sorted({split(command)[:2] for _, command in shown_commands()} | {("grpo-run", None)},
                    key=str)
    done = subprocess.run([sys.executable, "-c", HELP_SCRIPT, json.dumps(wanted)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def help_text(program: str, subcommand: str | None) -> str:
    return help_texts()[f"{program} {subcommand}"]


def own_and_training(arguments: list[str]) -> tuple[list[str], list[str]]:
    """`grpo-run launch ... -- <training arguments>`: the launcher's and the run's."""
    if "--" not in arguments:
        return arguments, []
    cut = arguments.index("--")
    return arguments[:cut], arguments[cut + 1:]


def flags(arguments: list[str]) -> list[str]:
    return [argument.split("=")[0] for argument in arguments if argument.startswith("--") and argument != "--"]


def test_the_pages_show_commands_of_every_program():
    shown = {split(command)[:2] for _, command in shown_commands()}
    assert {("grpo-run", None), ("grpo-run", "export"), ("grpo-run", "launch"), ("grpo-bench", "rollout"),
            ("grpo-bench", "flops")} <= shown


@pytest.mark.parametrize("page,command", shown_commands())
def test_every_flag_of_a_shown_command_exists(page, command):
    program, subcommand, arguments = split(command)
    own, training = own_and_training(arguments)
    text = help_text(program, subcommand)
    if flags(own):
        assert "usage" in text, f"{page}: `{command}`: {program} {subcommand or ''} --help printed no usage"
    for flag in flags(own):
        assert re.search(rf"{re.escape(flag)}\b", text), f"{page}: `{command}`: {flag} is not an option"
    for flag in flags(training):
        assert re.search(rf"{re.escape(flag)}\b", help_text("grpo-run", None)), f"{page}: {flag} after --"


@pytest.mark.parametrize("page,command", [(page, command) for page, command in shown_commands()
                                          if re.search(r"--config configs/\S+\.yaml", command)])
def test_shown_configs_exist_and_their_overrides_load(page, command):
    own, training = own_and_training(split(command)[2])
    arguments = training or own
    config = REPO / arguments[arguments.index("--config") + 1]
    assert config.is_file(), f"{page}: `{command}`: {config} does not exist"
    overrides = [argument for argument in arguments if re.match(r"^[a-z_]+(\.[a-z_]+)+=", argument)]
    if any(is_placeholder(override) for override in overrides):
        return
    expected = shown_errors().get((page, command))
    if expected is None:
        load_config(config, overrides, registry=default_registry())  # plugin options checked too
        return
    with pytest.raises(ConfigError) as refused:
        load_config(config, overrides, registry=default_registry())
    assert " ".join(str(refused.value).split()) == expected, f"{page}: `{command}` prints another error"


def is_placeholder(override: str) -> bool:
    """`key=...`, `key=SEED`, `key=$SEED`: a value the reader fills in."""
    value = override.partition("=")[2]
    return "..." in value or "$" in value or re.fullmatch(r"[A-Z][A-Z_]*", value) is not None


@cache
def shown_errors() -> dict[tuple[str, str], str]:
    """(page, command) -> the one-line error a fenced block shows right under the command."""
    found = {}
    for page in shown_pages():
        for block in FENCE.findall(page.read_text()):
            lines = block.replace("\\\n", " ").splitlines()
            for line, after in zip(lines, lines[1:]):
                if after.startswith("grpo-run: error: "):
                    found.update({(page.name, command): after.removeprefix("grpo-run: error: ")
                                  for command in _command(line)})
    return found
