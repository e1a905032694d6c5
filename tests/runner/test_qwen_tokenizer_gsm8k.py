"""The GSM8K path as the presets run it, with Qwen3's real tokenizer (BPE, 151,669 tokens,
ChatML template) from ../shared/data/qwen3-tokenizer and the full GSM8K data from
../shared/data/gsm8k; skipped when either is absent.

Qwen2.5 and Qwen3 share the BPE vocabulary and the ChatML format; Qwen2.5's template adds
a default system message when the config sets none, which is rendered here explicitly so
the Qwen2.5 presets are measured with the prompt they really get.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import numpy as np

from grpo_core.config_io import load_config, plugin_options
from grpo_core.tool_calls import tool_schema
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.assembly.build import sampling_params, stop_token_ids
from grpo_runner_gsm8k.samplers.multi_turn_step import build_tools, tool_prompt_ids
from grpo_runner_gsm8k.tokens import prompt_token_ids
from grpo_runner_gsm8k.training.scoring import score
from grpo_runner_gsm8k.tasks.gsm8k import Gsm8kTask, final_answer, read_jsonl

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
TOKENIZER, GSM8K = SHARED / "qwen3-tokenizer", SHARED / "gsm8k"
# The GSM8K presets of Qwen models (the others use their own family's tokenizer and chat template).
PRESETS = sorted((REPO / "configs").glob("gsm8k_qwen*.yaml"))
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

pytestmark = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file() or not (GSM8K / "test.jsonl").is_file(),
                                reason="needs ../shared/data/qwen3-tokenizer and ../shared/data/gsm8k")


@pytest.fixture(scope="module")
def tokenizer():
    from grpo_core.tokenizer import load_tokenizer

    return load_tokenizer(str(TOKENIZER))


def preset_task(cfg, data: Path = GSM8K) -> Gsm8kTask:
    spec = default_registry().get("task", cfg.task.name)  # gsm8k or gsm8k_tools
    return spec.factory(plugin_options(spec.options, {**cfg.task.options, "path": str(data)}, "task.options"),
                        seed=cfg.task.seed)


def preset_prompt_lengths(cfg, tokenizer, examples) -> np.ndarray:
    """Token counts of the examples' prompts as the preset's run renders them: with the offered
    tools in the chat template when it rolls out multi-turn, else as a plain prompt."""
    system_prompt = system_prompt_of(cfg)
    if cfg.rollout.multi_turn.enabled:
        offered = [tool_schema(tool) for tool in build_tools(cfg.rollout.multi_turn, default_registry())]
        rows = tool_prompt_ids(tokenizer, [ex.messages(system_prompt) for ex in examples], offered)
    else:
        rows = prompt_token_ids(tokenizer, examples, use_chat_template=True, system_prompt=system_prompt,
                                max_prompt_length=10**6)
    return np.array([len(row) for row in rows])


def system_prompt_of(cfg) -> str | None:
    if cfg.task.system_prompt is None and "Qwen2.5" in (cfg.model.path or ""):
        return QWEN25_DEFAULT_SYSTEM
    return cfg.task.system_prompt


def test_the_tokenizer_is_qwen3s(tokenizer):
    assert len(tokenizer) == 151_669
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_gsm8k_prompt_fits_the_presets_max_prompt_length(preset, tokenizer, capsys):
    cfg = load_config(preset)
    task = preset_task(cfg)
    train, test = task.train_examples(), task.test_examples()
    assert len(train) + len(test) == 8_792 and task.use_chat_template
    lengths = preset_prompt_lengths(cfg, tokenizer, train + test)
    with capsys.disabled():
        print(f"\n{preset.name}: longest prompt {lengths.max()} tokens (train {lengths[:len(train)].max()}), "
              f"{(lengths <= 512).mean():.2%} within 512, max_prompt_length {cfg.rollout.max_prompt_length}")
    assert lengths.max() <= cfg.rollout.max_prompt_length


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_generation_stops_on_im_end(preset, tokenizer):
    cfg = load_config(preset)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in sampling_params(cfg.rollout, stop_token_ids(cfg.rollout, tokenizer)).stop_token_ids
    assert im_end in sampling_params(cfg.rollout, stop_token_ids(cfg.rollout, tokenizer), cfg.eval).stop_token_ids


def test_gold_solutions_encoded_and_decoded_score_1(tokenizer):
    """Each gold solution, as the model would emit it (tokens, then <|im_end|>), decoded the
    way the runner decodes completions, earns the full correctness reward."""
    rows = read_jsonl(GSM8K / "train.jsonl") + read_jsonl(GSM8K / "test.jsonl")
    completions = [row["answer"] + "<|im_end|>" for row in rows]
    ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
    correctness = default_registry().get("reward", "correctness")
    reward_fn = correctness.factory(plugin_options(correctness.options, {}, "task.reward_options.correctness"))
    scores = score({"correctness": (reward_fn, 1.0)}, decoded, [final_answer(row["answer"]) for row in rows])
    assert len(rows) == 8_792
    assert scores.total.min() == 1.0


# Qwen2.5-0.5B-Instruct's published config.json (architecture only: --print-config reads no weights).
QWEN25_0P5B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
               "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
               "num_key_value_heads": 2, "max_position_embeddings": 32768, "vocab_size": 151936,
               "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
               "torch_dtype": "bfloat16"}


def test_the_gsm8k_tools_preset_loads_with_print_config(tmp_path, tokenizer, capsys):
    """Every load-time check of the preset passes on the real tokenizer and GSM8K data. On the
    first 8 GSM8K questions, a limit one token under their longest prompt as measured here is
    refused in one line naming that length: the run renders what the measurement renders."""
    import json

    from grpo_runner_gsm8k.cli import main

    preset = REPO / "configs" / "gsm8k_tools_qwen25_0p5b_1gpu.yaml"
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_0P5B))
    argv = ["--config", str(preset), "--print-config", f"model.path={tmp_path}", f"model.tokenizer={TOKENIZER}",
            f'task.system_prompt="{QWEN25_DEFAULT_SYSTEM}"']  # as Qwen2.5's template adds it
    assert main([*argv, f"task.options.path={GSM8K}"]) == 0
    printed = capsys.readouterr().out
    assert "name: gsm8k_tools" in printed and "tools:\n    - calculator\n    - python" in printed

    few = tmp_path / "few"
    few.mkdir()
    rows = (GSM8K / "train.jsonl").read_text().splitlines()[:8]
    for split in ("train", "test"):
        (few / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    cfg = load_config(preset)
    examples = preset_task(cfg, few).train_examples()
    longest = int(preset_prompt_lengths(cfg, tokenizer, examples).max())
    assert main([*argv, f"task.options.path={few}", f"rollout.max_prompt_length={longest - 1}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"has {longest} tokens with the tools offered, more than " in err[0]

