"""Example `grpo_meshes` plugin: Mesh strategies selectable with `mesh.strategy: <name>`.

A complete plugin module (register it in pyproject.toml as
`[project.entry-points.grpo] my_plugin = "my_plugin.plugin"`); tests/e2e/test_hookspec_examples.py
trains one step of the tiny config with it.
"""

from dataclasses import dataclass
import jax, numpy as np
from jax.sharding import Mesh
from grpo_core import MeshSpec, hookimpl

@dataclass(frozen=True)
class Options:
    pass

class DataOnly:
    param_rules = ()                    # every weight replicated
    activation_rules = (("batch", "dp"),)

    def mesh_shape(self, devices=None):
        return (len(devices or jax.devices()), 1, 1)

    def build_mesh(self, devices=None):
        devices = np.asarray(devices or jax.devices())
        return Mesh(devices.reshape(self.mesh_shape(list(devices))), ("dp", "fsdp", "tp"))

@hookimpl
def grpo_meshes():
    return [MeshSpec("data_only", lambda options: DataOnly(), Options,
                     "Pure data parallelism")]
