"""The tasks of `eval.tasks`, built from their plugins and checked once at start."""

from __future__ import annotations

from typing import Any

from grpo_core.errors import UserError
from grpo_core.registry import Registry

from grpo_runner_gsm8k.assembly.build import from_plugin
from grpo_runner_gsm8k.tasks.graders import use_graders_of
from grpo_runner_gsm8k.tokens import run_prompt_ids


def eval_tasks(tasks: dict, registry: Registry, seed: int) -> dict[str, Any]:
    """The tasks of `eval.tasks` (name -> options), seeded with task.seed, built whole on every
    process (all processes pass the same questions to the rollout)."""
    tasks = tasks or {}
    use_graders_of(registry)
    if not isinstance(tasks, dict):
        raise UserError(f"eval.tasks must map task names to options, got {tasks!r}; e.g. eval.tasks={{math500: {{}}}}")
    return {name: from_plugin(registry, "task", name, options or {}, f"eval.tasks.{name}", seed=seed)
            for name, options in tasks.items()}


def checked_eval_tasks(run, registry: Registry, turns: Any = None) -> dict[str, Any]:
    """`eval_tasks` with every test prompt tokenized once, so one that is too long fails before
    training; turns: a multi-turn run's eval rollout, which renders the prompts of the tasks it
    offers the tools to (grpo_runner_gsm8k.evaluation.multi_turn)."""
    tasks = eval_tasks(run.cfg.eval.tasks, registry, run.cfg.task.seed)
    for task in tasks.values():
        examples = task.test_examples(run.cfg.eval.num_questions)
        if turns is not None and turns.offers(task):
            turns.check(task, examples)
        else:
            run_prompt_ids(run, task.use_chat_template, examples)
    return tasks
