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

from grpo_core.config_io import load_config, plugin_options
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.assembly.build import sampling_params, stop_token_ids
from grpo_runner_gsm8k.tokens import prompt_token_ids
from grpo_runner_gsm8k.training.scoring import score
from grpo_runner_gsm8k.tasks.gsm8k import Gsm8kOptions, Gsm8kTask, final_answer, read_jsonl

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
TOKENIZER, GSM8K = SHARED / "qwen3-tokenizer", SHARED / "gsm8k"
PRESETS = sorted((REPO / "configs").glob("gsm8k_*.yaml"))
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

pytestmark = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file() or not (GSM8K / "test.jsonl").is_file(),
                                reason="needs ../shared/data/qwen3-tokenizer and ../shared/data/gsm8k")


@pytest.fixture(scope="module")
def tokenizer():
    from grpo_core.tokenizer import load_tokenizer

    return load_tokenizer(str(TOKENIZER))


def preset_task(cfg) -> Gsm8kTask:
    options = plugin_options(Gsm8kOptions, {**cfg.task.options, "path": str(GSM8K)}, "task.options")
    return Gsm8kTask(options, seed=cfg.task.seed)


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
    examples = task.train_examples() + task.test_examples()
    assert len(examples) == 8_792
    lengths = [len(row) for row in prompt_token_ids(tokenizer, examples, use_chat_template=task.use_chat_template,
                                                    system_prompt=system_prompt_of(cfg), max_prompt_length=10**6)]
    with capsys.disabled():
        print(f"\n{preset.name}: longest prompt {max(lengths)} tokens, max_prompt_length "
              f"{cfg.rollout.max_prompt_length}")
    assert max(lengths) <= cfg.rollout.max_prompt_length


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
