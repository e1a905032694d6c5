"""Regrading a samples.jsonl (`grpo-run eval ... --regrade OUT/TASK/samples.jsonl`): every row
carries its task, question, reference and completion, so its grade and the task's summary are
recomputed from the file and the config alone, with no model. The summary is the one
summary.json holds (less `seconds`) when the grader and eval.k are those the eval ran with;
the rows whose verdict the grader now gives differently are counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from grpo_core.contracts import CompletionText
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.assembly.build import from_plugin
from grpo_runner_gsm8k.assembly.eval_tasks import eval_tasks
from grpo_runner_gsm8k.evaluation.evaluate import GradedTask, Sample, judge_grades, samples_metrics, task_grades
from grpo_runner_gsm8k.evaluation.store import read_samples, read_state


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"--regrade {path}: no such file; give the samples.jsonl of an eval (<out>/<task>/samples.jsonl)")
    rows = read_samples(path)
    missing = next((r for r in rows if not {"task", "reference", "completion"} <= set(r)), None)
    if not rows or missing is not None:
        raise UserError(f"--regrade {path}: {'no sample rows' if not rows else 'rows without task, reference and completion'}"
                        "; regrade a samples.jsonl written by this version of grpo-run eval (older files lack them)")
    tasks = {r["task"] for r in rows}
    if len(tasks) != 1:
        raise UserError(f"--regrade {path}: rows of several tasks ({', '.join(sorted(map(str, tasks)))}); give one "
                        "task's samples.jsonl")
    return rows


def by_question(rows: list[dict]) -> list[list[dict]]:
    """The rows of each question in file order (the first row of a (question, sample) pair wins,
    as a resumed eval reads them), each question's samples by index."""
    questions: dict[str, dict[int, dict]] = {}
    for row in rows:
        questions.setdefault(row["id"], {}).setdefault(row["sample"], row)
    return [[samples[i] for i in sorted(samples)] for samples in questions.values()]


def _completion(row: dict) -> CompletionText:
    return CompletionText(row["completion"], row.get("tokens") or 0, row.get("max_tokens") or 0,
                          bool(row.get("finished")))


def grades(cfg, task_name: str, options: dict, rows: list[dict]) -> list:
    """The task's grades of the rows, as the eval grades them (its grader, else eval.reward)."""
    task = eval_tasks({task_name: options}, default_registry(), cfg.task.seed)[task_name]
    completions = [_completion(r) for r in rows]
    if isinstance(task, GradedTask):
        return task_grades(task, completions, [r["reference"] for r in rows])
    judge = cfg.eval.reward
    if judge not in cfg.task.rewards:
        raise UserError(f"eval.reward = {judge!r} is not one of task.rewards ({', '.join(cfg.task.rewards)}); set "
                        "eval.reward to the reward the eval judged with")
    reward = from_plugin(default_registry(), "reward", judge, cfg.task.reward_options.get(judge, {}),
                         f"task.reward_options.{judge}")
    return judge_grades(cfg, {judge: (reward, 1.0)}, completions, [r["reference"] for r in rows])


def regrade_file(cfg, path: Path, ks: list[int], options_of: Callable[[str], dict]) -> tuple[dict[str, Any], int, int]:
    """(the summary of the regraded samples, verdicts that differ from the file, rows regraded);
    options_of: a task name -> its options, as the eval resolves them."""
    questions = by_question(_rows(path))
    sizes = {len(q) for q in questions}
    if len(sizes) != 1:
        raise UserError(f"--regrade {path}: questions hold different numbers of samples ({sorted(sizes)}); an "
                        "interrupted eval's file is regraded after the same command has finished it")
    rows = [r for question in questions for r in question]
    graded = grades(cfg, rows[0]["task"], options_of(rows[0]["task"]), rows)
    n = sizes.pop()
    samples = [Sample(r["completion"], g.answer, g.correct, r.get("tools")) for r, g in zip(rows, graded)]
    settings = read_state(path.parent / "settings.json") if (path.parent / "settings.json").is_file() else {}
    greedy = bool(settings.get("greedy", cfg.eval.greedy))
    summary = samples_metrics([samples[q * n:(q + 1) * n] for q in range(len(questions))],
                              [q[0].get("fields") or {} for q in questions], greedy, ks)
    summary.update(task=rows[0]["task"], model=settings.get("model"), n=n, greedy=greedy)
    changed = sum(bool(r["correct"]) != g.correct for r, g in zip(rows, graded))
    return summary, changed, len(rows)
