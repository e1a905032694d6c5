"""The 8-device mesh the rollout layout tests share."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    """dp x fsdp x tp = 2 x 2 x 2 over the 8 fake CPU devices tests/conftest.py asks for."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "fsdp", "tp"))
