"""When jax.distributed is initialised, and the process-count guard (single process)."""

import pytest

from grpo_core.config import MeshConfig
from grpo_meshes import MeshError, distributed_reason, setup_processes
from grpo_meshes.distributed import with_slurm_settings
from grpo_meshes.slurm import expand_nodelist


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


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-10],b3", ["a8", "a9", "a10", "b3"]),
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
])
def test_slurm_nodelist_expands_in_order(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-", "node[3-1]", "a,,b", "node[x]"])
def test_unreadable_slurm_nodelist_is_a_clear_error(nodelist):
    with pytest.raises(MeshError, match="cannot read the"):
        expand_nodelist(nodelist)


SLURM = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n[1-4]",
         "SLURM_STEP_NODELIST": "gpu[03-04,09]-ib"}


def test_slurm_step_gives_process_fields_and_required_count():
    filled = with_slurm_settings(MeshConfig(), SLURM)
    assert (filled.coordinator_address, filled.num_processes, filled.process_id) == ("gpu03-ib:8476", 4, 2)
    assert filled.require_process_count == 4
    job_only = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert with_slurm_settings(MeshConfig(), {**job_only, "GRPO_COORDINATOR_PORT": "9000"}
                               ).coordinator_address == "n1:9000"


def test_slurm_settings_leave_set_fields_and_off_alone():
    own = MeshConfig(coordinator_address="head:1234", require_process_count=4)
    assert with_slurm_settings(own, SLURM).coordinator_address == "head:1234"
    assert with_slurm_settings(MeshConfig(distributed="off"), SLURM) == MeshConfig(distributed="off")
    assert with_slurm_settings(MeshConfig(), {**SLURM, "SLURM_NTASKS": "1"}) == MeshConfig()
    with pytest.raises(MeshError, match="GRPO_COORDINATOR_PORT='70000' is not a TCP port"):
        with_slurm_settings(MeshConfig(), {**SLURM, "GRPO_COORDINATOR_PORT": "70000"})
