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
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import CheckpointConfig, RunConfig
from grpo_core.config_io import build_dataclass, config_to_dict
from grpo_core.errors import UserError

CHECKPOINTS = "checkpoints"
ITEMS = ("params", "opt_state", "meta", "config")
# Settings that may change when a run resumes: they alter neither the model, the data
# order nor the math of an update (length of the run, memory/speed knobs, logging).
MAY_CHANGE_ON_RESUME = ("train.steps", "train.micro_batch_size_per_device", "model.remat", "loss.impl",
                        "loss.options", "mesh", "eval", "logging", "checkpoint")
_ABSENT = object()  # a key one of two configs lacks


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


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


def saved_params(run_dir: str | Path, step: int, target: Any) -> Any:
    """The params of checkpoint `step`, placed where `target` (ShapeDtypeStructs with
    shardings, in the params' tree structure) says."""
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


def resume_step(cfg: RunConfig, required: bool = False) -> Optional[int]:
    """The step to continue from (the newest complete checkpoint of logging.dir), or None
    for a fresh start. Reads only, so a refused resume writes nothing."""
    run_dir = Path(cfg.logging.dir)
    steps = complete_steps(run_dir)
    if not steps:
        if required:
            raise UserError(f"--resume: no complete checkpoint in {checkpoint_dir(run_dir)}; run without "
                            "--resume to start, or set logging.dir to the directory of the run to continue")
        return None
    if cfg.checkpoint.resume == "never" and not required:
        raise UserError(f"logging.dir {str(run_dir)!r} already holds checkpoints (newest: step {steps[-1]}) and "
                        "checkpoint.resume is 'never'; set logging.dir to a new directory, or pass --resume")
    step = steps[-1]
    check_compatible(saved_config(run_dir, step), config_to_dict(cfg), checkpoint_dir(run_dir) / str(step))
    if step > cfg.train.steps:
        raise UserError(f"the checkpoint in {run_dir} is at step {step}, past train.steps={cfg.train.steps}; "
                        f"set train.steps >= {step} to continue the run")
    return step


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


class Checkpointer:
    """Saves and restores the train state (a `loop.TrainState`) of one run directory."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig):
        self.every_steps = cfg.every_steps
        self.directory = checkpoint_dir(run_dir)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(cfg.keep),
            cleanup_tmp_directories=True,  # what a killed save left behind
            enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    def due(self, step: int, last_step: int) -> bool:
        """Every `every_steps` steps, and always after the last step (0 = only then)."""
        return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def save(self, state: Any, data_position: dict, model_config: dict, run_config: dict) -> None:
        meta = {"step": state.step, "skipped_steps": state.skipped_steps, "data": data_position,
                "key": _key_record(state.key), "model_config": model_config}
        self.manager.save(state.step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(run_config)))

    def restore(self, step: int, state: Any, task: Any, mesh: Mesh) -> None:
        """Sets `state` and the task's data position from checkpoint `step`; the arrays land
        on `mesh` with the shardings of `state`'s arrays."""
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
        """Waits for a save in flight, then releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
