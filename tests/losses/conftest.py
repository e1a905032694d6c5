"""Shared builders for the loss tests (exposed as fixtures: tests run with
--import-mode=importlib, so test modules cannot import each other)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig

# Every value of every math option of the `loss` section.
OPTION_VALUES = {
    "aggregation": ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_length_norm"],
    "importance_sampling_level": ["token", "sequence"],
    # (beta, kl_estimator, kl_importance_weighted)
    "kl": [(0.0, "k3", False), (0.05, "k1", False), (0.05, "k2", False), (0.05, "k3", False), (0.05, "k3", True)],
    "epsilon_c": [None, 3.0],
    "logratio_clamp": [None, 0.5],
    "entropy": [(0.0, False), (0.0, True), (0.02, True)],  # (entropy_coef, compute_entropy)
    "clip": [(0.2, 0.2), (0.1, 0.28)],  # (epsilon_low, epsilon_high)
    "old_logp": [False, True],  # False: on-policy (old = stop_grad(logp))
}


def config_of(case: dict) -> LossConfig:
    """The LossConfig of one OPTION_VALUES combination."""
    (beta, estimator, weighted), (coef, compute), (low, high) = case["kl"], case["entropy"], case["clip"]
    return LossConfig(aggregation=case["aggregation"], importance_sampling_level=case["importance_sampling_level"],
                      beta=beta, kl_estimator=estimator, kl_importance_weighted=weighted, epsilon_c=case["epsilon_c"],
                      logratio_clamp=case["logratio_clamp"], entropy_coef=coef, compute_entropy=compute,
                      epsilon_low=low, epsilon_high=high, max_completion_length=16)


def case_id(case: dict) -> str:
    parts = [case["aggregation"], case["importance_sampling_level"], f"beta{case['kl'][0]}-{case['kl'][1]}{'-isw' if case['kl'][2] else ''}",
             f"ec{case['epsilon_c']}", f"clamp{case['logratio_clamp']}", f"ent{case['entropy'][0]}-{case['entropy'][1]}",
             f"clip{case['clip'][0]}-{case['clip'][1]}", "old" if case["old_logp"] else "onpolicy"]
    return ",".join(parts)


def pytest_generate_tests(metafunc):
    """`pairwise_case`: every pair of option values; `each_value_case`: every value once."""
    for name, strength in (("pairwise_case", 2), ("each_value_case", 1)):
        if name in metafunc.fixturenames:
            cases = covering_cases(OPTION_VALUES, strength)
            metafunc.parametrize(name, cases, ids=[case_id(c) for c in cases])


def make_problem(batch: int, time: int, hidden: int, vocab: int, *, seed: int = 0, lengths=None,
                 dtype=jnp.float32) -> SimpleNamespace:
    """Random inputs of a GRPO micro-batch. lengths[b] = completion tokens of row b
    (right padding); logits have a realistic spread (std ~ 1.5)."""
    rng = np.random.default_rng(seed)
    lengths = np.full(batch, time) if lengths is None else np.asarray(lengths)
    h = rng.normal(size=(batch, time, hidden)).astype(np.float32)
    w = (rng.normal(size=(hidden, vocab)) * 1.5 / np.sqrt(hidden)).astype(np.float32)
    mask = (np.arange(time)[None, :] < lengths[:, None]).astype(np.float32)
    base = -np.log(vocab) + rng.normal(size=(batch, time)) * 0.5
    return SimpleNamespace(
        hidden=jnp.asarray(h, dtype), lm_head=jnp.asarray(w, dtype),
        targets=jnp.asarray(rng.integers(0, vocab, size=(batch, time)), jnp.int32),
        mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=batch) + 0.3, jnp.float32),
        # old/ref log-probs near the policy's own so ratios straddle the clip range
        old_noise=jnp.asarray(rng.normal(size=(batch, time)) * 0.3, jnp.float32),
        ref_noise=jnp.asarray(rng.normal(size=(batch, time)) * 0.2, jnp.float32),
        base_logp=jnp.asarray(base, jnp.float32),
        cotangents=jnp.asarray(rng.normal(size=(2, batch, time)), jnp.float32))


def max_rel_err(actual, expected) -> float:
    """max |a - e| / max |e| (the scale-aware relative error used throughout)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(expected))), 1e-12)
    return float(np.max(np.abs(actual - expected))) / scale


def assert_tree_close(actual, expected, rtol: float = 1e-5) -> None:
    leaves_a, tree_a = jax.tree.flatten(actual)
    leaves_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, f"structure differs: {tree_a} vs {tree_e}"
    for i, (a, e) in enumerate(zip(leaves_a, leaves_e)):
        assert np.all(np.isfinite(np.asarray(a))), f"leaf {i} has non-finite values"
        err = max_rel_err(a, e)
        assert err <= rtol, f"leaf {i} {np.shape(e)}: relative error {err:.3g} > {rtol}"


def covering_cases(options: dict[str, list], strength: int = 2) -> list[dict]:
    """A small set of option combinations containing every `strength`-wise
    combination of values at least once (greedy covering array; deterministic).
    strength=1: every value appears; strength=2: every pair of values appears."""
    names = list(options)
    uncovered = {(cols, vals) for cols in itertools.combinations(range(len(names)), strength)
                 for vals in itertools.product(*(range(len(options[names[c]])) for c in cols))}
    candidates = list(itertools.product(*(range(len(options[n])) for n in names)))
    cases = []
    def tuples_of(cand) -> set:
        return {(cols, tuple(cand[c] for c in cols)) for cols in itertools.combinations(range(len(names)), strength)}

    while uncovered:
        best = max(candidates, key=lambda cand, todo=uncovered: len(tuples_of(cand) & todo))
        uncovered -= tuples_of(best)
        cases.append({n: options[n][i] for n, i in zip(names, best)})
    return cases


@pytest.fixture
def helpers() -> SimpleNamespace:
    return SimpleNamespace(make_problem=make_problem, max_rel_err=max_rel_err, assert_tree_close=assert_tree_close,
                           covering_cases=covering_cases, config_of=config_of, option_values=OPTION_VALUES)
