"""Fixtures the runner's TPU-compiler tests share."""

import pytest


@pytest.fixture
def tpu_devices(monkeypatch):
    """The 8 devices of a v6e-8 (v6e:2x4) from the TPU compiler, compile only; skips without libtpu."""
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile only: other processes may hold libtpu
    topologies = pytest.importorskip("jax.experimental.topologies")
    try:
        return topologies.get_topology_desc("v6e:2x4", platform="tpu").devices
    except Exception as exc:  # no libtpu (or no TPU plugin) on this machine
        pytest.skip(f"libtpu not available: {exc}")
