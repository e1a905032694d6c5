"""Two real JAX processes on CPU (jax.distributed on 127.0.0.1, gloo collectives).

Every subprocess runs under a hard timeout, so a broken coordinator can never hang CI.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from grpo_core.testing import cpu_test_xla_flags

WORKER = Path(__file__).with_name("multiprocess_worker.py")
DEVICES_PER_PROCESS = 4
HARD_TIMEOUT_S = 120
FAIL_FAST_BOUND_S = 25  # the guard must end the run well under 30 s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(mode: str, num_processes: int, launched: int, *extra: str,
           env_of=lambda process_id: {}) -> list[subprocess.Popen]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": cpu_test_xla_flags(DEVICES_PER_PROCESS)}
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(WORKER), mode, port, str(num_processes), str(i), *extra],
                             env={**env, **env_of(i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(launched)]


def slurm_env(process_id: int, port: int) -> dict[str, str]:
    """What `srun --ntasks=2` on one node gives each task; the node list is compressed, and
    its first entry (127.0.0.1) is the coordinator."""
    return {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": str(process_id),
            "SLURM_LOCALID": str(process_id), "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "GRPO_COORDINATOR_PORT": str(port)}


def collect(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process; kills all of them past the deadline."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in processes:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in processes:
            proc.kill()
            proc.communicate()
        pytest.fail(f"multi-process run did not finish within {timeout} s")
    return results


def expected_weighted_sum(blocks: list[np.ndarray]) -> float:
    rows = np.concatenate(blocks)
    return float(np.sum(rows * np.arange(1, len(rows) + 1)[:, None]))


@pytest.mark.slow
def test_two_processes_build_meshes_and_reduce_a_global_batch():
    results = collect(launch("mesh", 2, 2), HARD_TIMEOUT_S)
    for code, out, err in results:
        assert code == 0, f"worker failed with {code}:\n{err[-3000:]}"
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    n = DEVICES_PER_PROCESS
    for i, report in enumerate(reports):
        assert report["layout"] == [i, 2, n, 2 * n, True]
        assert report["auto"] == {"shape": [1, 2 * n, 1], "processes": [[0] * n + [1] * n]}
        assert report["host_local"] == {"shape": [2, n, 1], "processes": [[0] * n, [1] * n]}
        # a local batch of 3 rows cannot split over this process's 4 fsdp devices
        assert "local batch of 3 rows on process %d is not divisible by the %d row blocks" % (i, n) in report["indivisible"]
        assert "nearest being 4 (global 8)" in report["indivisible"]
        # fsdp over both hosts while host-local was asked for warns; dp over the hosts does not
        assert len(report["warn_1"]) == 1 and "spans processes [0, 1]" in report["warn_1"][0]
        assert report["warn_2"] == []
    blocks = [np.asarray(report["rows"]) for report in reports]
    concatenated = expected_weighted_sum(blocks)
    for report in reports:
        sums = report["sums"]
        assert sums["auto_train"] == pytest.approx(concatenated)
        assert sums["auto_legacy"] == pytest.approx(concatenated)
        assert sums["host_local_train"] == pytest.approx(concatenated)
        assert sums["host_local_maxtext"] == pytest.approx(concatenated)
        assert sums["auto_maxtext_replicated"] == pytest.approx(expected_weighted_sum(blocks[:1]))


@pytest.mark.slow
def test_two_of_three_required_processes_fail_fast_with_a_clear_message():
    results = collect(launch("join", 3, 2, "3"), FAIL_FAST_BOUND_S)
    for code, out, err in results:
        assert code == 3, f"expected the join-timeout exit status 3, got {code}:\n{err[-3000:]}"
        assert "MeshError: not all 3 processes joined jax.distributed within mesh.init_timeout_s=3 s" in err
        assert "Launch the run on every host" in err
        assert out == ""


def test_two_tasks_of_a_slurm_step_join_from_slurms_variables_alone():
    port = free_port()
    # JAX's own Slurm detection would serve on 61440 + job id % 4096; that port is held here,
    # so only the documented GRPO_COORDINATOR_PORT works.
    with socket.socket() as taken:
        taken.bind(("", 61440 + 4242 % 4096))
        taken.listen()
        results = collect(launch("slurm", 2, 2, env_of=lambda i: slurm_env(i, port)), HARD_TIMEOUT_S)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"task {i} failed with {code}:\n{err[-3000:]}"
        layout = json.loads(out.strip().splitlines()[-1])["layout"]
        assert layout == [i, 2, DEVICES_PER_PROCESS, 2 * DEVICES_PER_PROCESS, True]


def test_distributed_on_without_a_coordinator_is_a_clear_error():
    script = ("from grpo_core.config import MeshConfig\n"
              "from grpo_meshes import MeshError, setup_processes\n"
              "try:\n"
              "    setup_processes(MeshConfig(distributed='on', init_timeout_s=5), environ={})\n"
              "except MeshError as exc:\n"
              "    print(exc)\n")
    # No cluster for jax to detect: drop the variables of the launchers it knows.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TPU_", "KUBERNETES_", "JAX_COORDINATOR", "PMI_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_test_xla_flags(2))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=HARD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("jax.distributed.initialize failed (mesh.distributed is 'on'; "
                                  "coordinator_address=None, num_processes=None, process_id=None)")
    assert "set mesh.coordinator_address (host:port of process 0)" in proc.stdout
