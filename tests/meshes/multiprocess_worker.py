"""One process of the two-process CPU test (run by test_multiprocess.py, never by pytest).

usage: python multiprocess_worker.py <mode> <port> <num_processes> <process_id> [init_timeout_s]
mode "mesh": join, build auto / host_local, assemble global batches from this
process's rows, reduce them, and print one JSON line with what was seen.
mode "join": only set up the processes (used to check the process-count guard).
mode "slurm": set up the processes from Slurm's variables alone (port and ids unused).
"""

import json
import sys
import warnings

import jax

# CPU cross-process collectives (the default in current jax; set so the test says what it needs).
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from grpo_core.config import MeshConfig  # noqa: E402
from grpo_meshes import (  # noqa: E402
    MeshError,
    MeshWarning,
    build_mesh_from_config,
    global_batch,
    rollout_batch_sharding,
    setup_processes,
    train_batch_sharding,
)

ROWS_PER_PROCESS = 8


def local_rows(process_id: int) -> np.ndarray:
    """[8, 3] rows whose values tell which process and row they came from."""
    return (1000 * process_id + np.arange(ROWS_PER_PROCESS * 3)).reshape(ROWS_PER_PROCESS, 3).astype(np.float32)


def weighted_sum(array: jax.Array) -> float:
    """sum_r (r + 1) * sum_c x[r, c]: depends on the row order, reduced across processes."""
    replicated = NamedSharding(array.sharding.mesh, PartitionSpec())
    weights = jnp.arange(1, array.shape[0] + 1, dtype=jnp.float32)[:, None]
    return float(jax.jit(lambda x: jnp.sum(x * weights), out_shardings=replicated)(array))


def mesh_report(strategy: str) -> dict:
    mesh = build_mesh_from_config(MeshConfig(strategy=strategy)).mesh
    return {"shape": [mesh.shape[a] for a in mesh.axis_names],
            "processes": [[d.process_index for d in row.flat] for row in mesh.devices]}


def batch_sums(process_id: int) -> dict:
    auto = build_mesh_from_config(MeshConfig(strategy="auto")).mesh
    host_local = build_mesh_from_config(MeshConfig(strategy="host_local")).mesh
    rows = local_rows(process_id)
    shared = local_rows(0)  # replicated batch axes: every process passes the same rows
    return {
        "auto_train": weighted_sum(global_batch(rows, train_batch_sharding(auto))),
        "auto_legacy": weighted_sum(global_batch(rows, rollout_batch_sharding(auto, "legacy"))),
        "host_local_train": weighted_sum(global_batch(rows, train_batch_sharding(host_local))),
        "host_local_maxtext": weighted_sum(global_batch(rows, rollout_batch_sharding(host_local, "maxtext"))),
        "auto_maxtext_replicated": weighted_sum(global_batch(shared, rollout_batch_sharding(auto, "maxtext"))),
    }


def indivisible_error() -> str:
    auto = build_mesh_from_config(MeshConfig(strategy="auto")).mesh
    try:
        global_batch(np.zeros((3, 2), np.float32), train_batch_sharding(auto))
    except MeshError as exc:
        return str(exc)
    return ""


def host_local_warnings(shape: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_mesh_from_config(MeshConfig(strategy=shape, options={"fsdp_within_host": True}))
    return [str(w.message) for w in caught if issubclass(w.category, MeshWarning)]


def main() -> None:
    mode, port, num_processes, process_id = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    timeout = int(sys.argv[5]) if len(sys.argv) > 5 else 30
    if mode == "slurm":
        layout = setup_processes(MeshConfig(init_timeout_s=timeout))
    else:
        config = MeshConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                            process_id=process_id, require_process_count=num_processes, init_timeout_s=timeout)
        layout = setup_processes(config, environ={})
    report = {"layout": [layout.process_index, layout.process_count, layout.local_device_count,
                         layout.device_count, layout.distributed]}
    if mode == "mesh":
        report.update(rows=local_rows(process_id).tolist(), auto=mesh_report("auto"), host_local=mesh_report("host_local"), sums=batch_sums(process_id),
                      indivisible=indivisible_error(), warn_1=host_local_warnings("1,-1,1"),
                      warn_2=host_local_warnings("2,-1,1"))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
