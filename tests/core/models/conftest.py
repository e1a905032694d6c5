"""Shared fixtures: the golden fixture definitions, tiny configs, param randomisation."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(HERE, "make_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def golden():
    """The make_golden module: FAMILIES, golden_inputs, GOLDEN_DIR, HF helpers."""
    return _load_make_golden()


def randomize_params(model: nnx.Module, seed: int, std: float = 0.2) -> nnx.Module:
    """Redraw every parameter ~ N(0, std), norm scales ~ N(1, std), in place (host RNG),
    so logits are O(1) like a trained model's and layout mistakes cannot hide."""
    rng = np.random.RandomState(seed)

    def draw(path, x):
        centre = 1.0 if path[-1] == "scale" else 0.0
        return jnp.asarray(rng.normal(centre, std, x.shape), x.dtype)

    state = nnx.state(model, nnx.Param)
    nnx.update(
        model, jax.tree_util.tree_map_with_path(lambda p, x: draw([k.key for k in p if hasattr(k, "key")], x), state)
    )
    return model


@nnx.jit
def forward_logits(model, ids, mask, positions):
    """Jitted model(ids, mask) -> logits [B, T, V] (eager op-by-op dispatch is slow)."""
    return model.logits(model(ids, attention_mask=mask, positions=positions))


def logits_np(model, ids, mask=None, positions=None) -> np.ndarray:
    ids = jnp.asarray(ids)
    mask = jnp.ones(ids.shape, jnp.int32) if mask is None else jnp.asarray(mask)
    positions = None if positions is None else jnp.asarray(positions)
    return np.asarray(forward_logits(model, ids, mask, positions))


@pytest.fixture
def randomize():
    return randomize_params


@pytest.fixture
def logits_of():
    """logits_of(model, ids, mask=None, positions=None) -> numpy logits, jitted."""
    return logits_np


@pytest.fixture
def left_padded():
    """make(vocab, batch, length, pads) -> (ids, mask) as numpy int32, pads per row."""

    def make(vocab: int, length: int, pads=(0, 2, 5), seed: int = 0):
        rng = np.random.RandomState(seed)
        ids = rng.randint(1, vocab, size=(len(pads), length)).astype(np.int32)
        mask = np.ones_like(ids)
        for row, n in enumerate(pads):
            ids[row, :n], mask[row, :n] = 0, 0
        return ids, mask

    return make


@pytest.fixture(scope="session")
def mesh8():
    """dp=1, fsdp=4, tp=2 over the 8 fake CPU devices (Auto axes)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.make_mesh((1, 4, 2), ("dp", "fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


@pytest.fixture
def tpu_devices():
    """v6e 2x2 devices of the TPU compiler (libtpu, ahead of time; no TPU needed); skips without libtpu."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is not installed")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: other processes may hold libtpu
    from jax.experimental import topologies

    return topologies.get_topology_desc("v6e:2x2", platform="tpu").devices
