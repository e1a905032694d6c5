"""Every test process sees 8 fake CPU devices, so sharding tests need no subprocess; the
fixtures below are shared by the tests that start from configs/tiny.yaml."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

pytest_plugins = ["grpo_core.testing"]

REPO = Path(__file__).resolve().parents[1]
# 8 devices hold 64 rows: 8 per device, so the micro-batch sizes 1, 2, 4, 8 are valid.
PLAN_SHAPE = ("rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=8")


@pytest.fixture(scope="session")
def tiny_config_path() -> str:
    """configs/tiny.yaml: the tiny CPU run every runner test starts from."""
    return str(REPO / "configs" / "tiny.yaml")


@pytest.fixture
def tiny_config(tiny_config_path, tmp_path):
    """`tiny_config(*overrides, registry=None)`: the tiny config with `overrides`, its run
    directory under the test's tmp_path, checked against `registry` (default: the installed one)."""
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry

    def load(*overrides: str, registry=None):
        return load_config(tiny_config_path, [f"logging.dir={tmp_path / 'run'}", *overrides],
                           registry=registry or default_registry())

    return load


@pytest.fixture(scope="session")
def plan_overrides() -> list[str]:
    """The plan tests' shape (PLAN_SHAPE) as command-line overrides."""
    return list(PLAN_SHAPE)


@pytest.fixture
def plan_config(tiny_config, plan_overrides):
    """`plan_config(*overrides)`: the tiny config at the plan tests' shape."""
    return lambda *overrides: tiny_config(*plan_overrides, *overrides)
