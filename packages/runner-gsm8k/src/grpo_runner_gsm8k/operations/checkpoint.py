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

import errno
import os
import re
import shutil
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import CheckpointConfig, RunConfig
from grpo_core.config_io import build_dataclass, config_to_dict, resolve_defaults
from grpo_core.contracts import Task
from grpo_core.errors import RunFault, UserError
from grpo_core.models import QwenConfig

from grpo_runner_gsm8k.operations import orbax_noise
from grpo_runner_gsm8k.operations.resume_config import check_compatible

CHECKPOINTS = "checkpoints"
ITEMS = ("params", "opt_state", "meta", "config")
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


def check_param_layout(meta: dict, where: Path) -> None:
    """Refuses, in one line, a checkpoint (its `meta`, read from `where`) written before
    decoder layers were stacked."""
    if meta.get("param_layout") != PARAM_LAYOUT:
        raise UserError(f"checkpoint {where} was written by an older version with "
                        "one parameter subtree per decoder layer, which this version (layers stacked for one "
                        "scan) cannot restore; start a new logging.dir, or export it with the older version "
                        "and set model.path to the export")


# ---- resuming --------------------------------------------------------------------------
def _read_json(run_dir: Path, step: int, item: str) -> dict:
    return _read_item(run_dir, step, item, ocp.JsonCheckpointHandler(), ocp.args.JsonRestore())


@dataclass(frozen=True)
class Resume:
    """Checkpoint steps of a run, newest first (the first that restores is used), with the
    config and meta of the first, read once: the one reader of a step's config and meta
    (resuming and export both read a step through it)."""

    run_dir: Path
    steps: list[int]
    config: dict  # the resolved run config the step was written with, as saved
    meta: dict

    @classmethod
    def read(cls, run_dir: str | Path, newest_first: list[int]) -> "Resume":
        """From the newest of `newest_first` whose config and meta read; an unreadable one is
        skipped with a warning, the oldest's error is raised."""
        run_dir = Path(run_dir)
        for i, step in enumerate(newest_first):
            try:
                return cls(run_dir, newest_first[i:], _read_json(run_dir, step, "config"),
                           _read_json(run_dir, step, "meta"))
            except UserError as exc:
                if i + 1 == len(newest_first):
                    raise
                warn_fallback(checkpoint_dir(run_dir) / str(step), exc, newest_first[i + 1])
        raise UserError(f"no checkpoint to resume from in {checkpoint_dir(run_dir)}")

    @property
    def step(self) -> int:
        return self.steps[0]

    @property
    def where(self) -> Path:
        return checkpoint_dir(self.run_dir) / str(self.step)

    @property
    def run_config(self) -> RunConfig:
        """The RunConfig the step was written with (its "same as X" defaults filled in, as
        a config written before they were filled in at load would lack them)."""
        return resolve_defaults(build_dataclass(RunConfig, self.config))

    @property
    def model_config(self) -> QwenConfig:
        """The model's HF config, as the run built it."""
        return QwenConfig.from_hf_dict(self.meta["model_config"])

    def params(self, target: Any) -> Any:
        """The step's params, placed where `target` (ShapeDtypeStructs with shardings, in the
        params' tree structure) says."""
        check_param_layout(self.meta, self.where)
        return _read_item(self.run_dir, self.step, "params", ocp.StandardCheckpointHandler(),
                          ocp.args.StandardRestore(target))


def resume_point(run_dir: Path, settings: dict, required: bool = False) -> Optional[Resume]:
    """The checkpoints in `run_dir` (logging.dir) to continue from, or None for a fresh start; `settings`
    (config_to_dict of the run's config) is compared whole with the checkpoint's, its checkpoint.resume and
    train.steps decide. A newest checkpoint whose config or meta cannot be read is skipped with a warning.
    Reads only, so a refused resume writes nothing."""
    steps = complete_steps(run_dir)
    if not steps:
        if required:
            raise UserError(f"--resume: no complete checkpoint in {checkpoint_dir(run_dir)}; run without "
                            "--resume to start, or set logging.dir to the directory of the run to continue")
        return None
    if settings["checkpoint"]["resume"] == "never" and not required:
        raise UserError(f"logging.dir {str(run_dir)!r} already holds checkpoints (newest: step {steps[-1]}) and "
                        "checkpoint.resume is 'never'; set logging.dir to a new directory, or pass --resume")
    resume = Resume.read(run_dir, steps[::-1])
    # settings added since the step was saved compare at their defaults, which that run used
    check_compatible(config_to_dict(resume.run_config), settings, resume.where)
    check_param_layout(resume.meta, resume.where)
    if resume.step > (last_step := settings["train"]["steps"]):
        raise UserError(f"the checkpoint in {run_dir} is at step {resume.step}, past train.steps={last_step}; "
                        f"set train.steps >= {resume.step} to continue the run")
    return resume


# Python's "[Errno 28] No space left on device" and TensorStore's "...: File too large [os_error_code='27']"
OS_ERROR = re.compile(r"\[Errno \d+\] ([^:'\]]+)|: ([^:\]\n]+?) \[os_error_code")
# What a full disk, a file-size limit or lost permissions say, wherever a wrapper puts the text.
STORAGE_ERRORS = tuple(os.strerror(code) for code in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                                      errno.EACCES, errno.EIO))


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
        known = next((text for text in STORAGE_ERRORS if text in str(link)), None)
        if known:
            return f"OSError: {known}"
    innermost = chain[-1]
    text = " ".join(str(innermost).split())
    if len(text) > 200:  # the start says where, the end usually why
        text = f"{text[:90]} ... {text[-105:]}"
    return f"{type(innermost).__name__}: {text}"


def warn_fallback(where: Path, exc: BaseException, step: int) -> None:
    print(f"grpo-run: warning: checkpoint {where} is unreadable ({cause_of(exc)}); resuming from step {step}",
          file=sys.stderr)


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
    carried: Optional[dict] = None  # partial rollouts: the pool of carried rows (grpo_rollout.partial)


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
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    def due(self, step: int, last_step: int) -> bool:
        """Every `every_steps` steps, and always after the last step (0 = only then)."""
        return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def save(self, state: TrainState, data_position: dict, model_config: dict, run_config: dict,
             lora_base: Optional[dict] = None) -> None:
        """`lora_base`: a LoRA run's base fingerprint (its params are then the adapters)."""
        self.wait()  # orbax would wait for the previous save anyway; its error belongs to that step
        meta = {"step": state.step, "skipped_steps": state.skipped_steps, "data": data_position,
                "key": _key_record(state.key), "model_config": model_config, "param_layout": PARAM_LAYOUT}
        if lora_base:
            meta["lora_base"] = lora_base
        if state.carried is not None:
            meta["carried"] = state.carried
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
        orbax_noise.quiet_after_failed_save()
        where = self.directory / str(self.pending_step)
        return RunFault(f"saving checkpoint {where} failed ({cause_of(exc)}); earlier checkpoints in "
                         f"{self.directory} are intact; free space or fix permissions there and run the same "
                         "command again to continue")

    def restore_newest(self, resume: Resume, state: TrainState, task: Task, mesh: Mesh) -> int:
        """Restores the newest of `resume.steps` whose arrays read back; ones that do not are
        skipped with a warning and moved aside, so later saves can use their steps."""
        candidates = resume.steps
        for i, step in enumerate(candidates):
            try:
                self.restore(step, state, task, mesh, resume.meta if i == 0 else None)
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

    def restore(self, step: int, state: TrainState, task: Task, mesh: Mesh, meta: Optional[dict] = None) -> None:
        """Sets `state` and the task's data position from checkpoint `step` (its `meta` when
        already read); the arrays land on `mesh` with the shardings of `state`'s arrays."""
        meta = Resume.read(self.directory.parent, [step]).meta if meta is None else meta
        check_param_layout(meta, self.directory / str(step))
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_on_mesh(state.params, mesh)),
            opt_state=ocp.args.StandardRestore(_on_mesh(state.opt_state, mesh))))
        state.params, state.opt_state = restored.params, restored.opt_state
        state.key, state.step, state.skipped_steps = _key_from_record(meta["key"]), meta["step"], meta["skipped_steps"]
        state.carried = meta.get("carried")
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
            self._release_manager()

    def _release_manager(self) -> None:
        """Releasing the manager writes too: on a full disk it fails like the save it follows, and
        says so once (a failure already reported, or being raised, is not reported again)."""
        try:
            self.manager.close()
        except OSError as exc:
            if not self.failed:
                raise self._save_failed(exc) from None
