"""`grpo-run report RUN_DIR [--out PNG]`: one PNG of a run's metrics.jsonl.

Four panels over training steps: reward (total and per reward function), eval
accuracy (and pass@n, and each eval.tasks entry's greedy accuracy or mean@n), valid
tokens per second, and step time (with its rollout and update parts). Default output:
RUN_DIR/report.png. When `grpo-run eval` wrote summaries under RUN_DIR/eval, a second
PNG (<out>-pass-at-k.png) plots pass@k and maj@k by k.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

from grpo_core.errors import UserError

from grpo_runner_gsm8k.cli import ArgumentParser
from grpo_runner_gsm8k.commands.pass_at_k_plot import eval_summaries, pass_at_k_figure

FIGURE_INCHES, DPI = (12, 8), 100


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    main: bool = True  # the panel's headline series (drawn thicker)


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    lines: tuple[Line, ...]
    log_y: bool = False


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="grpo-run report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's logging.dir (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="PNG", help="image to write (default: RUN_DIR/report.png)")
    return parser


# ---- reading ---------------------------------------------------------------------------------
def read_metrics(path: Path) -> list[dict]:
    """The records of metrics.jsonl, one per step (the last record wins), sorted by step."""
    if not path.is_file():
        raise UserError(f"{str(path)!r} not found; pass the logging.dir of a run that has logged a step")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    by_step: dict[int, dict] = {}
    for number, line in enumerate(lines, 1):
        record = _parse_line(path, number, line, last=number == len(lines))
        if record is not None:
            by_step[record["step"]] = record
    if not by_step:
        raise UserError(f"{str(path)!r} holds no metrics; report a run that has finished at least one step")
    return [by_step[step] for step in sorted(by_step)]


def _parse_line(path: Path, number: int, line: str, last: bool) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        if last:  # a run killed while writing leaves a partial last line
            warnings.warn(f"{path}:{number} is cut off ({exc.msg}); it is left out of the report")
            return None
        raise UserError(f"{path}:{number} is not valid JSON ({exc.msg}); fix or remove the line") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise UserError(f"{path}:{number} is not a metrics record with an integer 'step'; "
                        "pass the metrics.jsonl written by grpo-run")
    return record


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `key` was logged with a number (null = non-finite, left out)."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [float(v) for _, v in points]


# ---- panels ----------------------------------------------------------------------------------
def reward_functions(records: list[dict]) -> list[str]:
    names = {key.split("/")[2] for r in records for key in r
             if key.startswith("train-reward/func/") and key.endswith("/mean")}
    return sorted(names)


def eval_keys(records: list[dict]) -> list[str]:
    keys = {key for r in records for key in r if key.startswith("eval/pass@")}
    tasks = {key for r in records for key in r if _task_headline(key)}
    return ["eval/accuracy", *sorted(keys), *sorted(tasks)]


def _task_headline(key: str) -> bool:
    """eval/<task>/greedy_accuracy or eval/<task>/mean@n (an eval.tasks entry), not a breakdown."""
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "eval" and (parts[2] == "greedy_accuracy" or parts[2].startswith("mean@"))


def panels(records: list[dict]) -> list[Panel]:
    rewards = tuple(Line(f"train-reward/func/{name}/mean", name, main=False) for name in reward_functions(records))
    evals = tuple(Line(key, key.split("/", 1)[1], main=key == "eval/accuracy") for key in eval_keys(records))
    return [
        Panel("Reward", "mean reward", (Line("train-reward/total/mean", "total (weighted)"), *rewards)),
        Panel("Eval accuracy", "fraction correct", evals),
        Panel("Tokens/s", "valid completion tokens / s",
              (Line("throughput/train/valid_tokens_per_s", "tokens/s"),)),
        Panel("Step time", "seconds", (Line("time/train/step_s", "step"),
                                       Line("time/train/rollout_s", "rollout", main=False),
                                       Line("time/train/update_s", "update", main=False)),
              log_y=True),  # the first steps compile and would flatten the rest on a linear axis
    ]


def draw_panel(ax, panel: Panel, records: list[dict]) -> None:
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    drawn = 0
    for line in panel.lines:
        steps, values = series(records, line.key)
        if steps:
            ax.plot(steps, values, label=line.label, linewidth=2.0 if line.main else 1.0,
                    marker="o" if len(steps) <= 30 else None, markersize=3)
            drawn += 1
    if drawn and panel.log_y:
        ax.set_yscale("log")
    if drawn > 1:
        ax.legend(fontsize="small")
    if not drawn:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def build_figure(records: list[dict], title: str) -> Figure:
    fig = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    fig.suptitle(f"{title} — {len(records)} steps logged, last step {records[-1]['step']}")
    for ax, panel in zip(fig.subplots(2, 2).flat, panels(records)):
        draw_panel(ax, panel, records)
    return fig


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    run_dir = Path(args.run_dir).expanduser()
    records = read_metrics(run_dir / "metrics.jsonl")
    out = Path(args.out).expanduser() if args.out else run_dir / "report.png"
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {str(out)!r}: the report is a PNG image; give a path ending in .png")
    if not out.parent.is_dir():
        raise UserError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist; create it first")
    write_png(build_figure(records, run_dir.resolve().name), out)
    print(f"wrote {out}")
    summaries = eval_summaries(run_dir)
    if summaries:  # what grpo-run eval wrote under the run
        passk = out.with_name(f"{out.stem}-pass-at-k.png")
        write_png(pass_at_k_figure(summaries), passk)
        print(f"wrote {passk}")
    return 0


def write_png(figure: Figure, out: Path) -> None:
    try:
        figure.savefig(out, dpi=DPI)
    except OSError as exc:  # a read-only or full run directory
        with contextlib.suppress(OSError):
            out.unlink(missing_ok=True)  # what a full disk cut short
        raise UserError(f"cannot write the report {str(out)!r} ({type(exc).__name__}: {exc.strerror or exc}); "
                        "pass --out with a path in a writable directory") from None
