"""Greedy generation equals transformers `generate` token for token (golden fixtures made
by make_golden.py; the live comparison needs torch and is skipped without it)."""

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.contracts import Policy
from grpo_core.models import load_pretrained
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = ["qwen2", "qwen3", "llama3", "qwen3_moe"]


def golden(name):
    return json.loads((GOLDEN / name / "golden.json").read_text())


def greedy_tokens(name, eos=None, decode_attention="rollout", n=1, **options):
    record = golden(name)
    model = load_pretrained(GOLDEN / name, dtype="float32")
    params = SamplingParams(max_new_tokens=record["max_new_tokens"], greedy=True, n=n,
                            stop_token_ids=() if eos is None else (eos,))
    rollout = JaxRollout(JaxRolloutOptions(decode_attention=decode_attention, **options))
    rollout.load_weights(Policy.of(model))
    result = rollout.generate(record["prompts"], jax.random.key(0), params, pad_token_id=record["pad_id"])
    return np.asarray(result.completion_ids), result


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_transformers_generate(name):
    tokens, _ = greedy_tokens(name)
    np.testing.assert_array_equal(tokens, golden(name)["tokens"])


@pytest.mark.parametrize("decode_attention", ["rollout", "model"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_with_eos_equals_transformers_generate(name, decode_attention):
    record = golden(name)
    tokens, result = greedy_tokens(name, eos=record["eos"], decode_attention=decode_attention)
    np.testing.assert_array_equal(tokens, record["tokens_with_eos"])
    assert bool(result.finished.any()) and not bool(result.finished.all())  # the fixture ends some rows early


def load_maker():
    spec = importlib.util.spec_from_file_location("make_golden", Path(__file__).parent / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", FAMILIES)
def test_live_transformers_generate_matches(name):
    pytest.importorskip("torch")
    maker = load_maker()
    record = golden(name)
    hf_tokens, _ = maker.hf_greedy(GOLDEN / name, record["prompts"], eos=record["eos"])
    tokens, _ = greedy_tokens(name, eos=record["eos"])
    np.testing.assert_array_equal(tokens, hf_tokens)


@pytest.mark.parametrize("decode_attention", ["rollout", "model"])
def test_gemma3_greedy_equals_transformers_generate(decode_attention):
    """Sliding-window layers (4 slots, rows of up to 22 tokens) decoded by the rollout's own decode
    step (the default) and by the model's cached forward."""
    record = golden("gemma3")
    for eos, expected in ((None, record["tokens"]), (record["eos"], record["tokens_with_eos"])):
        tokens, _ = greedy_tokens("gemma3", eos=eos, decode_attention=decode_attention)
        np.testing.assert_array_equal(tokens, expected)


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("shared_prompt", [True, False])
def test_gemma3_greedy_two_samples_equal_transformers_generate(shared_prompt, segments):
    """n = 2 samples per prompt: shared, the prompt's cache kept once per group and read through the
    window by the cascade decode step; else one cache row per sample. 3 segments each read a shorter
    view of the cache."""
    record = golden("gemma3")
    tokens, _ = greedy_tokens("gemma3", eos=record["eos"], n=2, decode_segments=segments, shared_prompt=shared_prompt)
    np.testing.assert_array_equal(tokens[0::2], record["tokens_with_eos"])
    np.testing.assert_array_equal(tokens[1::2], record["tokens_with_eos"])


def split_greedy_tokens(mesh, gather_weights, shared_prompt, projector=None):
    """The golden Gemma 3 rows, n = 2, decoded greedily in a split layout over the 8 devices
    (`projector`: ranks the layouts `auto` compares)."""
    record = golden("gemma3")
    model = shard_model(load_pretrained(GOLDEN / "gemma3", dtype="float32"), mesh, DEFAULT_RULES)
    params = SamplingParams(max_new_tokens=record["max_new_tokens"], greedy=True, n=2, stop_token_ids=(record["eos"],))
    rollout = JaxRollout(JaxRolloutOptions(gather_weights=gather_weights, shared_prompt=shared_prompt))
    if projector is not None:
        rollout.project_decodes_with(projector)
    rollout.load_weights(Policy.of(model))
    result = rollout.generate(record["prompts"], jax.random.key(0), params, pad_token_id=record["pad_id"],
                              batch_sharding=NamedSharding(mesh, PartitionSpec(("dp", "fsdp", "tp"))))
    return np.asarray(result.completion_ids), record


@pytest.mark.parametrize("shared_prompt", [True, False])
def test_gemma3_greedy_model_parallel_equals_transformers_generate(mesh, shared_prompt):
    """8 rows (n = 2) over 8 devices, the weights split by heads, MLP columns and vocabulary."""
    tokens, record = split_greedy_tokens(mesh, "model_parallel", shared_prompt)
    np.testing.assert_array_equal(tokens[0::2], record["tokens_with_eos"])
    np.testing.assert_array_equal(tokens[1::2], record["tokens_with_eos"])


@pytest.mark.parametrize("shared_prompt", [True, False])
def test_gemma3_greedy_head_parallel_equals_transformers_generate(mesh, shared_prompt):
    """n = 2 over a (4 row groups, 2 KV head groups) grid of the 8 devices: each device attends over
    its rows' cache of its KV head within each sliding layer's window (4 slots, rows longer than
    it), the post-norms applied to the all-reduced attention and MLP outputs."""
    tokens, record = split_greedy_tokens(mesh, "head_parallel", shared_prompt)
    np.testing.assert_array_equal(tokens[0::2], record["tokens_with_eos"])
    np.testing.assert_array_equal(tokens[1::2], record["tokens_with_eos"])


def test_gemma3_auto_projects_the_head_parallel_decode(mesh, monkeypatch, capsys):
    """`auto` compares the head-parallel decode for Gemma 3 too: a fake projection ranks it fastest."""
    from grpo_rollout import gather

    monkeypatch.setattr(gather, "spare_device_bytes", lambda devices: 1 << 40)
    seconds = iter([4.0, 3.0, 2.0, 1.0])  # gather.LAYOUTS order: gathered, sharded, model-parallel, head-parallel
    tokens, record = split_greedy_tokens(mesh, "auto", False, projector=lambda compiled, steps: next(seconds) * steps)
    assert "gather_weights=auto: head_parallel weights" in capsys.readouterr().out
    np.testing.assert_array_equal(tokens[0::2], record["tokens_with_eos"])
    np.testing.assert_array_equal(tokens[1::2], record["tokens_with_eos"])
