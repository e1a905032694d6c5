"""When jax.distributed is initialised, and the process-count guard (single process)."""

import pytest

from grpo_core.config import MeshConfig
from grpo_meshes import MeshError, distributed_reason, setup_processes


@pytest.mark.parametrize("config, environ, reason", [
    (MeshConfig(distributed="off", coordinator_address="10.0.0.1:1234"), {"JAX_COORDINATOR_ADDRESS": "x:1"}, None),
    (MeshConfig(distributed="on"), {}, "mesh.distributed is 'on'"),
    (MeshConfig(), {}, None),
    (MeshConfig(coordinator_address="10.0.0.1:1234"), {}, "mesh.coordinator_address is set"),
    (MeshConfig(num_processes=4), {}, "mesh.num_processes is set"),
    (MeshConfig(), {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS is set"),
    (MeshConfig(), {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "TPU_WORKER_HOSTNAMES lists several TPU hosts"),
    (MeshConfig(), {"TPU_WORKER_HOSTNAMES": "w0"}, None),
    (MeshConfig(), {"SLURM_NTASKS": "8"}, "SLURM_NTASKS=8 (a multi-process launch)"),
    (MeshConfig(), {"OMPI_COMM_WORLD_SIZE": "1"}, None),
])
def test_distributed_reason(config, environ, reason):
    assert distributed_reason(config, environ, on_tpu_vm=False) == reason


def test_tpu_vm_initialises_in_auto_mode():
    assert distributed_reason(MeshConfig(), {}, on_tpu_vm=True) == "running on a Cloud TPU VM"
    assert distributed_reason(MeshConfig(distributed="off"), {}, on_tpu_vm=True) is None


def test_single_process_layout():
    layout = setup_processes(MeshConfig(distributed="off", require_process_count=1), environ={})
    assert (layout.process_index, layout.process_count, layout.device_count) == (0, 1, 8)
    assert layout.local_device_count == 8 and not layout.distributed


def test_one_process_when_three_are_required_fails_at_once():
    with pytest.raises(MeshError, match=r"only 1 of the 3 processes required by mesh.require_process_count "
                                        r"joined \(this is process 0, seeing 8 devices\).*--worker=all"):
        setup_processes(MeshConfig(distributed="off", require_process_count=3), environ={})


def test_config_contradiction_fails_before_any_wait():
    with pytest.raises(MeshError, match="mesh.num_processes is 2 but mesh.require_process_count is 3"):
        setup_processes(MeshConfig(num_processes=2, require_process_count=3, coordinator_address="127.0.0.1:1"))
