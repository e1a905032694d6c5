"""Multi-process start-up: jax.distributed.initialize with a bounded wait, and
the `mesh.require_process_count` guard against runs launched on too few hosts.

Call `setup_processes(mesh_config)` first thing, before any other JAX call.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import jax
from grpo_core.config import MeshConfig

from grpo_meshes.errors import MeshError
from grpo_meshes.slurm import slurm_process

# Exit status when not every process joined in time (the wait cannot be interrupted
# from Python, so the process reports and exits instead of raising).
JOIN_TIMEOUT_EXIT_CODE = 3
# jax's own deadline sits past ours so that our message comes first; its expiry
# aborts the process from C++ with a bare DEADLINE_EXCEEDED.
_JAX_DEADLINE_MARGIN_S = 10


@dataclass(frozen=True)
class ProcessLayout:
    """What this process sees after start-up."""

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    distributed: bool  # jax.distributed was initialised


def setup_processes(mesh_config: MeshConfig, environ: Optional[Mapping[str, str]] = None) -> ProcessLayout:
    """Initialise jax.distributed when asked for, then check the process count."""
    reason = distributed_reason(mesh_config, environ)
    mesh_config = with_slurm_settings(mesh_config, os.environ if environ is None else environ)
    check_configured_process_count(mesh_config)
    if reason is not None and not jax.distributed.is_initialized():
        initialize_distributed(mesh_config, reason)
    layout = current_layout()
    check_joined_process_count(mesh_config.require_process_count, layout)
    return layout


def with_slurm_settings(mesh_config: MeshConfig, environ: Mapping[str, str]) -> MeshConfig:
    """Under a multi-task `srun`, the unset process fields from Slurm's variables, and the
    process count required to be SLURM_NTASKS (a step that lost tasks then fails at start)."""
    found = slurm_process(environ) if mesh_config.distributed != "off" else None
    if found is None:
        return mesh_config
    fields = {"coordinator_address": found.coordinator_address, "num_processes": found.num_processes,
              "process_id": found.process_id, "require_process_count": found.num_processes}
    return dataclasses.replace(mesh_config, **{name: value for name, value in fields.items()
                                               if getattr(mesh_config, name) is None})


def current_layout() -> ProcessLayout:
    return ProcessLayout(jax.process_index(), jax.process_count(), jax.local_device_count(),
                         jax.device_count(), jax.distributed.is_initialized())


def distributed_reason(mesh_config: MeshConfig, environ: Optional[Mapping[str, str]] = None,
                       on_tpu_vm: Optional[bool] = None) -> Optional[str]:
    """Why jax.distributed should be initialised, or None when it should not."""
    if mesh_config.distributed != "auto":
        return "mesh.distributed is 'on'" if mesh_config.distributed == "on" else None
    for name in ("coordinator_address", "num_processes", "process_id"):
        if getattr(mesh_config, name) is not None:
            return f"mesh.{name} is set"
    env = os.environ if environ is None else environ
    return _environment_reason(env) or (
        "running on a Cloud TPU VM" if (_running_on_tpu_vm() if on_tpu_vm is None else on_tpu_vm) else None)


def _environment_reason(env: Mapping[str, str]) -> Optional[str]:
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS is set"
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        if len(env.get(name, "").split(",")) > 1:
            return f"{name} lists several TPU hosts"
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if env.get(name, "").isdigit() and int(env[name]) > 1:
            return f"{name}={env[name]} (a multi-process launch)"
    return None


def _running_on_tpu_vm() -> bool:
    try:  # private flag; pods are still detected through the variables above if it moves
        from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm
    except ImportError:
        return False
    return bool(running_in_cloud_tpu_vm)


def check_configured_process_count(mesh_config: MeshConfig) -> None:
    """Fail before any waiting when the config itself contradicts the requirement."""
    required, configured = mesh_config.require_process_count, mesh_config.num_processes
    if required is not None and configured is not None and required != configured:
        raise MeshError(f"mesh.num_processes is {configured} but mesh.require_process_count is {required}; "
                        f"set both to the number of hosts the run is launched on")


def check_joined_process_count(required: Optional[int], layout: ProcessLayout) -> None:
    if required is None or layout.process_count == required:
        return
    if layout.process_count < required:
        raise MeshError(
            f"only {layout.process_count} of the {required} processes required by "
            f"mesh.require_process_count joined (this is process {layout.process_index}, seeing "
            f"{layout.device_count} devices); the run was probably started on one host only: launch it on "
            f"every host (e.g. gcloud compute tpus tpu-vm ssh ... --worker=all), and off TPU pods set "
            f"mesh.coordinator_address, num_processes and process_id (or mesh.distributed: on)")
    raise MeshError(f"{layout.process_count} processes joined but mesh.require_process_count is {required}; "
                    f"set it to {layout.process_count} or launch on {required} hosts")


def initialize_distributed(mesh_config: MeshConfig, reason: str = "requested") -> None:
    """jax.distributed.initialize from the config (None fields are auto-detected),
    exiting with a clear message when the others do not join in time."""
    timeout = mesh_config.init_timeout_s
    watchdog = threading.Timer(timeout, _report_join_timeout, args=(mesh_config, reason))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=mesh_config.coordinator_address,
            num_processes=mesh_config.num_processes,
            process_id=mesh_config.process_id,
            initialization_timeout=timeout + _JAX_DEADLINE_MARGIN_S,
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise MeshError(_initialize_failure_message(mesh_config, reason, exc)) from exc
    finally:
        watchdog.cancel()


def _initialize_failure_message(mesh_config: MeshConfig, reason: str, exc: Exception) -> str:
    if "before any JAX" in str(exc):
        fix = "call grpo_meshes.setup_processes(mesh_config) before any other JAX call"
    else:
        fix = ("set mesh.coordinator_address (host:port of process 0), mesh.num_processes and "
               "mesh.process_id, run on a TPU pod / Slurm where they are detected, or set mesh.distributed: off")
    return (f"jax.distributed.initialize failed ({reason}; coordinator_address="
            f"{mesh_config.coordinator_address!r}, num_processes={mesh_config.num_processes!r}, "
            f"process_id={mesh_config.process_id!r}): {str(exc).rstrip('.')}; {fix}")


def _report_join_timeout(mesh_config: MeshConfig, reason: str) -> None:
    expected = mesh_config.num_processes or mesh_config.require_process_count or "all"
    message = (
        f"MeshError: not all {expected} processes joined jax.distributed within "
        f"mesh.init_timeout_s={mesh_config.init_timeout_s} s ({reason}; coordinator "
        f"{mesh_config.coordinator_address or 'auto-detected'}, this process id "
        f"{mesh_config.process_id if mesh_config.process_id is not None else 'auto-detected'}). "
        f"Launch the run on every host (e.g. --worker=all on a TPU pod), check that process 0 "
        f"is up and its port reachable, or raise mesh.init_timeout_s if hosts start slowly.")
    print(message, file=sys.stderr, flush=True)
    os._exit(JOIN_TIMEOUT_EXIT_CODE)
