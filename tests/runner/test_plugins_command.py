"""`grpo-run plugins` lists every kind, the tools, environments, tasks and graders included, with their package."""

import subprocess
import sys


def test_grpo_run_plugins_lists_the_tools_with_their_package():
    out = subprocess.run([sys.executable, "-m", "grpo_runner_gsm8k.cli", "plugins"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    section = out.split("tool:\n")[1].split("environment:")[0]
    assert [line.split()[:2] for line in section.splitlines()] == [["calculator", "grpo-tools"], ["python", "grpo-tools"]]
    families = out.split("model_family:\n")[1].split("grader:\n")[0]
    assert [line.split()[:2] for line in families.splitlines()] == [
        ["gemma3_text", "grpo-core"], ["llama", "grpo-core"], ["qwen2", "grpo-core"], ["qwen3", "grpo-core"],
        ["qwen3_moe", "grpo-core"]]
    graders = out.split("grader:\n")[1]
    assert [line.split()[:2] for line in graders.splitlines()] == [
        [name, "grpo-runner-gsm8k"] for name in ("choice", "code", "exact", "math", "number")]
    tasks = {line.split()[0] for line in out.split("task:\n")[1].split("advantage:")[0].splitlines()}
    assert {"dataset", "humaneval", "code_functions"} <= tasks
