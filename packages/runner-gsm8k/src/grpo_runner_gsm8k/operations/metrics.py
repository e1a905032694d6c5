"""Metric sinks: `<run_dir>/metrics.jsonl` (cut back to the resumed step on resume), Weights &
Biases, and progress on the terminal."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from grpo_core.config import LoggingConfig
from grpo_core.errors import RunFault
from grpo_runner_gsm8k.operations.atomic import write_text_atomic


def _plain(value: Any) -> Any:
    """JSON-safe scalars: numpy/jax scalars become Python numbers, non-finite become null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


class Progress:
    """A one-line bar on a TTY; plain periodic lines otherwise (log files, CI)."""

    def __init__(self, total_steps: int, every_steps: int, stream: TextIO | None = None):
        self.total, self.every = total_steps, every_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.monotonic()

    def _line(self, step: int, metrics: dict) -> str:
        elapsed = time.monotonic() - self.start
        eta = elapsed / max(step, 1) * (self.total - step)
        reward = _number(metrics.get("train-reward/total/mean"))
        tok_s = _number(metrics.get("throughput/train/valid_tokens_per_s"))
        acc = metrics.get("eval/accuracy")
        acc_text = f" eval_acc {acc:.3f}" if acc is not None else ""
        util = metrics.get("train-rollout/slot_utilisation")
        util_text = f" slots {util:.2f}" if util is not None else ""
        return (f"step {step}/{self.total} reward {reward:.3f} tok/s {tok_s:.0f}{util_text}{acc_text} "
                f"elapsed {elapsed:.0f}s eta {eta:.0f}s")

    def summary(self, metrics: dict, run_dir: Path, last_checkpoint: str) -> None:
        acc = metrics.get("eval/accuracy")
        acc_text = f"{acc:.3f}" if acc is not None else "n/a (eval.every_steps is 0)"
        self.stream.write(f"done: final eval accuracy {acc_text}, wall time {time.monotonic() - self.start:.0f}s, "
                          f"run dir {run_dir}, last checkpoint {last_checkpoint}\n")
        self.stream.flush()

    def update(self, step: int, metrics: dict) -> None:
        if self.tty:
            width = 20
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {self._line(step, metrics)}")
            self.stream.write("\n" if step >= self.total else "")
        elif step % self.every == 0 or step >= self.total:
            self.stream.write(self._line(step, metrics) + "\n")
        self.stream.flush()


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl, W&B (unless disabled) and the progress display."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, total_steps: int, config_dict: dict,
                 is_main_process: bool = True):
        self.run_dir = run_dir
        self.is_main = is_main_process
        self.progress = Progress(total_steps, cfg.every_steps)
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if is_main_process else None
        self.failed = False  # a write failed and was reported: closing repeats nothing
        self.wandb_run = self._start_wandb(cfg, config_dict) if is_main_process else None

    def _start_wandb(self, cfg: LoggingConfig, config_dict: dict):
        if cfg.wandb == "disabled":
            return None
        import wandb

        return wandb.init(mode=cfg.wandb, project=cfg.project, name=cfg.name, group=cfg.group,
                          dir=str(self.run_dir), config=config_dict)

    def log(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        except OSError as exc:  # a full disk or a run directory turned read-only
            raise self._write_failed(exc, f"step {step}") from None
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=step)
        self.progress.update(step, record)

    def summary(self, metrics: dict, last_checkpoint: str) -> None:
        """One closing line: final eval accuracy, wall time, run directory, last checkpoint."""
        self.progress.summary(metrics, self.run_dir, last_checkpoint)

    def _write_failed(self, exc: OSError, what: str) -> RunFault:
        self.failed = True
        return RunFault(f"writing {self.run_dir / 'metrics.jsonl'} ({what}) failed ({type(exc).__name__}: "
                         f"{exc.strerror or exc}); free space or fix permissions in {self.run_dir} and run the same "
                         "command again to continue from its last checkpoint")

    def close(self) -> None:
        if self.jsonl is not None:
            try:
                self.jsonl.close()
            except OSError as exc:
                if not self.failed:
                    raise self._write_failed(exc, "closing") from None
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _logged_at_or_before(line: str, last_step: int) -> bool:
    try:
        return int(json.loads(line)["step"]) <= last_step
    except (ValueError, KeyError, TypeError):
        return False  # a line cut short by a kill


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keeps the metrics.jsonl records of steps <= `last_step`: the steps logged after the
    checkpoint a run resumes from are run and logged again."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _logged_at_or_before(line, last_step)]
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(kept))  # a kill while cutting back must not lose the earlier steps
