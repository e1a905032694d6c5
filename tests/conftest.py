"""Every test process sees 8 fake CPU devices, so sharding tests need no subprocess."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

pytest_plugins = ["grpo_core.testing"]
