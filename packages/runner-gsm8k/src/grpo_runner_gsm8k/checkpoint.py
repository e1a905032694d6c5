"""Checkpoints of a run: `<logging.dir>/checkpoints/<step>/`, written with orbax.

A step directory holds four items:

    params/      policy parameters (sharded arrays, restored onto the current mesh)
    opt_state/   optimizer state
    meta/        step, skipped_steps, the task's data position, the RNG key, the model's
                 HF config (JSON)
    config/      the resolved run config (JSON, which any YAML reader loads)

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to
`<step>` once every item is on disk (an atomic rename on local filesystems; a commit
file on object stores). A crash during a save therefore leaves every earlier step
intact plus an unfinished tmp directory, which `complete_steps` never lists and the
next run's CheckpointManager deletes.

Not saved: the reference model of loss.beta > 0 (the initial policy, rebuilt from the
config) and step times. The data position is process 0's; every process takes the same
number of prompts per step, so it stands for all of them.

Saves are asynchronous: `save` returns once the arrays are copied to host memory (so
the next update may donate the device buffers) and the files are written in the
background; the next save and `close()` wait for them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import CheckpointConfig, RunConfig
from grpo_core.config_io import build_dataclass, config_to_dict
from grpo_core.contracts import Task
from grpo_core.errors import RunFault, UserError

CHECKPOINTS = "checkpoints"
ITEMS = ("params", "opt_state", "meta", "config")
# Settings that may change when a run resumes: they alter neither the model, the data
# order nor the math of an update (length of the run, memory/speed knobs, logging).
MAY_CHANGE_ON_RESUME = ("train.steps", "train.micro_batch_size_per_device", "model.remat", "model.scan_layers",
                        "loss.impl",
                        "loss.options", "mesh", "eval", "logging", "checkpoint")
_ABSENT = object()  # a key one of two configs lacks
# Written into every checkpoint's meta: decoder-layer params stacked over a leading axis.
# Checkpoints without it hold one subtree per layer, which this version cannot restore.
PARAM_LAYOUT = "stacked_layers"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / CHECKPOINTS  # orbax takes absolute paths only


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps whose save finished (unfinished tmp directories are not listed), ascending."""
    return sorted(ocp.path.step.checkpoint_steps(checkpoint_dir(run_dir)))


def _read_item(run_dir: str | Path, step: int, item: str, handler: ocp.CheckpointHandler,
               args: ocp.args.CheckpointArgs) -> Any:
    """One item of checkpoint `step`, read without a CheckpointManager (which would clean the
    directory up), so reading never changes a run directory."""
    where = checkpoint_dir(run_dir) / str(step)
    try:
        with ocp.Checkpointer(handler) as reader:
            return reader.restore(where / item, args=args)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"checkpoint {where} is unreadable ({type(exc).__name__}: {exc}); delete that "
                        "directory to fall back to the previous checkpoint") from None


def saved_config(run_dir: str | Path, step: int) -> dict:
    return _read_item(run_dir, step, "config", ocp.JsonCheckpointHandler(), ocp.args.JsonRestore())


def saved_meta(run_dir: str | Path, step: int) -> dict:
    return _read_item(run_dir, step, "meta", ocp.JsonCheckpointHandler(), ocp.args.JsonRestore())


def check_param_layout(run_dir: str | Path, step: int) -> None:
    """Refuses, in one line, a checkpoint written before decoder layers were stacked."""
    if saved_meta(run_dir, step).get("param_layout") != PARAM_LAYOUT:
        raise UserError(f"checkpoint {checkpoint_dir(run_dir) / str(step)} was written by an older version with "
                        "one parameter subtree per decoder layer, which this version (layers stacked for one "
                        "scan) cannot restore; start a new logging.dir, or export it with the older version "
                        "and set model.path to the export")


def saved_params(run_dir: str | Path, step: int, target: Any) -> Any:
    """The params of checkpoint `step`, placed where `target` (ShapeDtypeStructs with
    shardings, in the params' tree structure) says."""
    check_param_layout(run_dir, step)
    return _read_item(run_dir, step, "params", ocp.StandardCheckpointHandler(), ocp.args.StandardRestore(target))


def saved_run_config(run_dir: str | Path, step: int) -> RunConfig:
    """The RunConfig a checkpoint was written with."""
    return build_dataclass(RunConfig, saved_config(run_dir, step))


# ---- resuming --------------------------------------------------------------------------
def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1}: one entry per setting."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _may_change(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE_ON_RESUME)


def config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, current value)} for the keys a resume may not change."""
    old, new = flatten(saved), flatten(current)
    keys = sorted(set(old) | set(new))
    return {k: (old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys
            if not _may_change(k) and old.get(k, _ABSENT) != new.get(k, _ABSENT)}


def _shown(value: Any) -> str:
    return "unset" if value is _ABSENT else json.dumps(value)


def check_compatible(saved: dict, current: dict, where: Path) -> None:
    differences = config_differences(saved, current)
    if differences:
        detail = ", ".join(f"{k} (saved {_shown(a)}, now {_shown(b)})" for k, (a, b) in differences.items())
        raise UserError(f"cannot resume from {where}: the config differs in {detail}; use the saved values, "
                        "or set logging.dir to a new directory to start a fresh run")


def resume_steps(cfg: RunConfig, required: bool = False) -> list[int]:
    """The checkpoints to continue from, newest first (the first that restores is used), or []
    for a fresh start. A newest checkpoint whose config cannot be read is skipped with a
    warning. Reads only, so a refused resume writes nothing."""
    run_dir = Path(cfg.logging.dir)
    steps = complete_steps(run_dir)
    if not steps:
        if required:
            raise UserError(f"--resume: no complete checkpoint in {checkpoint_dir(run_dir)}; run without "
                            "--resume to start, or set logging.dir to the directory of the run to continue")
        return []
    if cfg.checkpoint.resume == "never" and not required:
        raise UserError(f"logging.dir {str(run_dir)!r} already holds checkpoints (newest: step {steps[-1]}) and "
                        "checkpoint.resume is 'never'; set logging.dir to a new directory, or pass --resume")
    candidates = _with_readable_config(run_dir, steps[::-1])
    step = candidates[0]
    check_compatible(saved_config(run_dir, step), config_to_dict(cfg), checkpoint_dir(run_dir) / str(step))
    check_param_layout(run_dir, step)
    if step > cfg.train.steps:
        raise UserError(f"the checkpoint in {run_dir} is at step {step}, past train.steps={cfg.train.steps}; "
                        f"set train.steps >= {step} to continue the run")
    return candidates


def _with_readable_config(run_dir: Path, newest_first: list[int]) -> list[int]:
    for i, step in enumerate(newest_first):
        try:
            saved_config(run_dir, step)
            saved_meta(run_dir, step)
        except UserError as exc:
            if i + 1 == len(newest_first):
                raise
            warn_fallback(checkpoint_dir(run_dir) / str(step), exc, newest_first[i + 1])
            continue
        return newest_first[i:]
    return []


# Python's "[Errno 28] No space left on device" and TensorStore's "...: File too large [os_error_code='27']"
OS_ERROR = re.compile(r"\[Errno \d+\] ([^:'\]]+)|: ([^:\]\n]+?) \[os_error_code")


def cause_of(exc: BaseException) -> str:
    """The cause of an error on one short line: the operating-system error when one is in the
    chain (orbax and TensorStore nest and reword them: "File too large", "No space left on
    device"), else the innermost error."""
    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for link in chain:
        if isinstance(link, OSError) and link.strerror:
            return f"{type(link).__name__}: {link.strerror}"
        found = OS_ERROR.search(str(link))
        if found:
            return f"OSError: {(found.group(1) or found.group(2)).strip()}"
    innermost = chain[-1]
    return f"{type(innermost).__name__}: {' '.join(str(innermost).split())[:200]}"


def _closed_loop_noise(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def drop_closed_loop_errors() -> None:
    """When a write of orbax's async save fails, TensorStore's completion callbacks of the
    other writes race the save's event-loop shutdown and raise 'Event loop is closed' on
    TensorStore's threads, reported through sys.excepthook / sys.unraisablehook. They only
    repeat a failure the run reports in one line: drop them, pass everything else on."""
    if getattr(sys.excepthook, "drops_closed_loop_errors", False):
        return
    previous_excepthook, previous_unraisablehook = sys.excepthook, sys.unraisablehook

    def excepthook(kind, value, tb):
        if not _closed_loop_noise(value):
            previous_excepthook(kind, value, tb)

    def unraisablehook(args):
        if not _closed_loop_noise(args.exc_value):
            previous_unraisablehook(args)

    excepthook.drops_closed_loop_errors = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class _UnretrievedSaveTasks(logging.Filter):
    """Drops asyncio's 'Task exception was never retrieved' records of orbax's write tasks:
    when a write fails, its sibling tasks may be garbage-collected before the run checks the
    save, and the failure reaches the user as the run's one error line anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Task exception was never retrieved") and "orbax" in message)


def drop_unretrieved_save_tasks() -> None:
    """Also the RuntimeWarning for the write coroutines a failed save never started (emitted
    whenever they are garbage-collected, at exit too)."""
    warnings.filterwarnings("ignore", message=r"coroutine 'async_serialize_from_host\.", category=RuntimeWarning)
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedSaveTasks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_UnretrievedSaveTasks())


def _quiet_thread_errors(args) -> None:
    """After a failed save is reported, orbax's background threads may still fail while the
    process exits; their tracebacks would only repeat that error."""


def warn_fallback(where: Path, exc: BaseException, step: int) -> None:
    print(f"grpo-run: warning: checkpoint {where} is unreadable ({cause_of(exc)}); resuming from step {step}",
          file=sys.stderr)


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
        path.write_text("".join(kept))


# ---- the train state -----------------------------------------------------------------
def _key_record(key: jax.Array) -> dict:
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}


def _key_from_record(record: dict) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(record["data"], dtype=np.uint32), impl=record["impl"])


def _on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Restore targets: arrays keep their mesh sharding; others (optimizer step counts,
    still on one device before the first update) are replicated over the mesh, as the
    jitted update returns them."""
    def target(x):
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(target, tree)


@dataclass
class TrainState:
    """Exactly what a checkpoint holds besides the task's data position."""

    params: Any
    opt_state: Any
    key: jax.Array
    step: int = 0
    skipped_steps: int = 0


class Checkpointer:
    """Saves and restores the train state (a `loop.TrainState`) of one run directory.

    A save that fails (full disk, lost permissions) stops the run with one line naming the
    step directory and the cause: at the next `check` (after every step), the next save or
    `close`, whichever comes first; earlier checkpoints stay as they were.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig):
        self.every_steps = cfg.every_steps
        self.directory = checkpoint_dir(run_dir)
        self.pending_step: Optional[int] = None  # the save that may still be in flight
        self.failed = self.closed = False
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(cfg.keep),
            cleanup_tmp_directories=True,  # what a killed save left behind
            enable_async_checkpointing=True)
        # orbax logs a failed background save with a traceback; `check` reports it in one line.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        drop_closed_loop_errors()
        drop_unretrieved_save_tasks()
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    def due(self, step: int, last_step: int) -> bool:
        """Every `every_steps` steps, and always after the last step (0 = only then)."""
        return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def save(self, state: TrainState, data_position: dict, model_config: dict, run_config: dict) -> None:
        self.wait()  # orbax would wait for the previous save anyway; its error belongs to that step
        meta = {"step": state.step, "skipped_steps": state.skipped_steps, "data": data_position,
                "key": _key_record(state.key), "model_config": model_config, "param_layout": PARAM_LAYOUT}
        self.pending_step = state.step
        try:
            self.manager.save(state.step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params), opt_state=ocp.args.StandardSave(state.opt_state),
                meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(run_config)))
        except Exception as exc:  # noqa: BLE001 - orbax and TensorStore raise many types
            raise self._save_failed(exc) from None

    def wait(self) -> None:
        """Waits for the save in flight; raises its one-line error if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            raise self._save_failed(exc) from None
        self.check()

    def check(self) -> None:
        """Raises the one-line error of a background save that failed."""
        try:
            self.manager.check_for_errors()
        except Exception as exc:  # noqa: BLE001
            raise self._save_failed(exc) from None

    def _save_failed(self, exc: BaseException) -> RunFault:
        self.failed = True
        threading.excepthook = _quiet_thread_errors
        sys.unraisablehook = _quiet_thread_errors
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # orbax's failed write tasks, never awaited
        # the run ends on this error; any write coroutine orbax abandoned with the save is moot
        warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)
        where = self.directory / str(self.pending_step)
        return RunFault(f"saving checkpoint {where} failed ({cause_of(exc)}); earlier checkpoints in "
                         f"{self.directory} are intact; free space or fix permissions there and run the same "
                         "command again to continue")

    def restore_newest(self, candidates: list[int], state: TrainState, task: Task, mesh: Mesh) -> int:
        """Restores the newest of `candidates` (newest first) whose arrays read back; ones that
        do not are skipped with a warning and moved aside, so later saves can use their steps."""
        for i, step in enumerate(candidates):
            try:
                self.restore(step, state, task, mesh)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - a truncated or partly deleted checkpoint
                if i + 1 == len(candidates):
                    raise UserError(f"no readable checkpoint in {self.directory}: step {step} is unreadable "
                                    f"({cause_of(exc)}); set logging.dir to a new directory to start over") from None
                warn_fallback(self.directory / str(step), exc, candidates[i + 1])
                continue
            self._move_aside([s for s in complete_steps(self.directory.parent) if s > step])
            return step
        raise UserError(f"no checkpoint to resume from in {self.directory}")

    def _move_aside(self, steps: list[int]) -> None:
        for step in steps:
            aside = self.directory / f"{step}.unreadable"
            shutil.rmtree(aside, ignore_errors=True)
            (self.directory / str(step)).rename(aside)
        if steps:
            self.manager.reload()

    def restore(self, step: int, state: TrainState, task: Task, mesh: Mesh) -> None:
        """Sets `state` and the task's data position from checkpoint `step`; the arrays land
        on `mesh` with the shardings of `state`'s arrays."""
        check_param_layout(self.directory.parent, step)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_on_mesh(state.params, mesh)),
            opt_state=ocp.args.StandardRestore(_on_mesh(state.opt_state, mesh)), meta=ocp.args.JsonRestore()))
        meta = restored.meta
        state.params, state.opt_state = restored.params, restored.opt_state
        state.key, state.step, state.skipped_steps = _key_from_record(meta["key"]), meta["step"], meta["skipped_steps"]
        try:
            task.restore(meta["data"])
        except ValueError as exc:
            raise UserError(f"checkpoint {self.directory / str(step)}: {exc}") from None

    def close(self) -> None:
        """Waits for a save in flight, then releases the manager; a failed save raises its
        one-line error unless it was reported already."""
        if self.closed:
            return
        self.closed = True
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as exc:  # noqa: BLE001
            if not self.failed:
                raise self._save_failed(exc) from None
        finally:
            self.manager.close()
