"""A `grpo_meshes` plugin: pure data parallelism (`mesh.strategy: data_only`); a
`grpo_core.contracts.MeshStrategy`."""

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
