"""Registration of the `jax` backend and the `grpo-bench rollout` JSON line."""

import json

import pytest

from grpo_core.config_io import plugin_options
from grpo_core.errors import ConfigError
from grpo_core.registry import build_registry
from grpo_rollout import JaxRollout, JaxRolloutOptions, bench


def test_jax_backend_is_registered_with_its_options():
    spec = build_registry(strict=True).rollout("jax")
    options = plugin_options(spec.options, {"prompt_buckets": [64, 8], "cache_dtype": "bfloat16"}, "rollout.options")
    assert options.prompt_buckets == (8, 64)
    assert isinstance(spec.factory(options), JaxRollout)


def test_bad_options_are_errors():
    with pytest.raises(ConfigError, match="rollout.options.prompt_bucket"):
        plugin_options(JaxRolloutOptions, {"prompt_bucket": [8]}, "rollout.options")
    with pytest.raises(ValueError, match="cache_dtype"):
        JaxRolloutOptions(cache_dtype="int8")


def test_bench_prints_one_json_line(capsys):
    flags = ["--vocab", "96", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--batch", "2",
             "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1"]
    assert bench.main(flags) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["generated_tokens"] == 6 and record["tokens_per_s"] > 0
    assert set(record["compiled_temp_bytes"]) == {"prefill", "decode"}
    assert {"prefill_ms", "decode_ms_per_token", "vocab", "batch"} <= set(record)
    # EOS suppressed: both rows decode 3 tokens, every slot used
    assert record["decode_steps"] == 3 and record["tokens_kept"] == 6 and record["slot_utilisation"] == 1.0
    assert record["length_p50"] == record["length_p90"] == record["length_max"] == 3


def test_bench_compares_shared_and_repeated_prompts_in_one_line(capsys):
    """2 prompts x n=2, greedy: both sides decode the same rows (same lengths, EOS suppressed)."""
    flags = ["--vocab", "96", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--batch", "4",
             "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1", "--compare-shared", "--n", "2", "--greedy"]
    assert bench.main(flags) == 0
    record = json.loads(capsys.readouterr().out.strip())
    repeated, shared = record["repeated_prompts"], record["shared_prompts"]
    assert repeated["generated_tokens"] == shared["generated_tokens"] == 12
    assert record["n"] == 2 and record["decode_speedup"] > 0 and record["tokens_per_s_speedup"] > 0


def test_bench_round_costs_compare_a_partial_round_with_and_without_the_prompt_table(capsys):
    """8 slots of groups of 4: the table runs 2 x 2 group prompts where every slot ran its own (8),
    and a decode step reads 4 table rows of the prompt where it read 8 cache rows."""
    flags = ["--vocab", "96", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--batch", "8",
             "--prompt-len", "32", "--new-tokens", "4", "--partial-budget", "2", "--round-costs", "--n", "4"]
    assert bench.main(flags) == 0
    record = json.loads(capsys.readouterr().out.strip())
    plain, shared = record["one_row_per_slot"], record["prompt_table"]
    assert shared["rollout prompt table"]["gflop"] < plain["rollout admission"]["gflop"]
    assert shared["rollout decode"]["mbytes"] < plain["rollout decode"]["mbytes"]
    assert "rollout admission" not in shared and record["decode_mbytes_ratio"] > 1


@pytest.mark.parametrize("quantile", [[], ["--partial-quantile", "0.5"]], ids=["fixed", "quantile"])
def test_partial_bench_compares_both_sides_on_the_same_rows(capsys, quantile):
    flags = ["--vocab", "96", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--batch", "8", "--n", "4",
             "--prompt-len", "4", "--new-tokens", "16", "--eos", "0", "--stop-p", "0.25", "--partial-budget", "4",
             "--steps", "2", "--warmup", "1", *quantile]
    assert bench.main(flags) == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["budget_quantile"] == (float(quantile[1]) if quantile else None)
    sync, partial = record["synchronous"], record["partial"]
    assert record["speedup"] == partial["tokens_per_s"] / sync["tokens_per_s"]
    for side in (sync, partial):
        assert side["tokens_kept"] > 0 and 0 < side["slot_utilisation"] <= 1
    assert sync["decode_steps_per_step"] <= 16  # a synchronous step waits at most max_new_tokens


def test_partial_bench_times_each_kv_cache_mode_on_the_same_rows(capsys):
    """The stop token's probability does not depend on the context, so every mode stops the same rows."""
    modes = ["within_step", "reprefill", "across_steps"]
    flags = ["--vocab", "96", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--batch", "8", "--n", "4",
             "--prompt-len", "4", "--new-tokens", "16", "--eos", "0", "--stop-p", "0.25", "--partial-budget", "4",
             "--steps", "2", "--warmup", "1", "--kv-cache", *modes]
    assert bench.main(flags) == 0
    record = json.loads(capsys.readouterr().out.strip())
    sides = [record[f"partial_{mode}"] for mode in modes]
    assert record["partial"] == sides[0] and record["kv_cache"] == modes
    assert len({side["tokens_kept"] for side in sides}) == 1 and sides[0]["tokens_kept"] > 0
    for mode, side in zip(modes, sides):
        assert record[f"speedup_{mode}"] == side["tokens_per_s"] / record["synchronous"]["tokens_per_s"]


def test_partial_bench_needs_the_length_model():
    with pytest.raises(SystemExit, match="--eos ID and --stop-p P"):
        bench.main(["--partial-budget", "4", "--vocab", "96", "--hidden", "32", "--layers", "1"])


def test_bench_compares_one_decode_loop_and_segments_in_one_line(capsys):
    """2 prompts x n=2, greedy, 5 new tokens in 2 segments: both sides decode every token."""
    flags = ["--vocab", "96", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--batch", "4",
             "--prompt-len", "4", "--new-tokens", "5", "--repeats", "1", "--compare-segments", "2", "--n", "2",
             "--greedy"]
    assert bench.main(flags) == 0
    record = json.loads(capsys.readouterr().out.strip())
    whole, segmented = record["one_loop"], record["segmented"]
    assert whole["generated_tokens"] == segmented["generated_tokens"] == 20
    assert whole["decode_steps"] == segmented["decode_steps"] == 5
    assert record["decode_segments"] == 2 and record["decode_speedup"] > 0 and record["tokens_per_s_speedup"] > 0
