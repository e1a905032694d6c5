"""Text to token ids and back, in one place: prompts are rendered (chat template or raw
question) and tokenized here, completions decoded here, for the loop, the step samplers and
evaluation alike. A leaf: it imports grpo_core and the multi-host read of arrays only, so any
runner module may use it.
"""

from __future__ import annotations

from typing import Any

from grpo_core.contracts import CompletionText, Example
from grpo_core.errors import UserError
from grpo_core.rollout_records import RolloutResult

from grpo_runner_gsm8k.multihost import host_array


def render_prompt(tokenizer: Any, example: Example, system_prompt: str | None = None,
                  use_chat_template: bool = True) -> str:
    """The prompt text to tokenize: the chat template with the generation prompt
    appended, or (`use_chat_template=False`) the system prompt and question joined
    by a newline, for tokenizers without a template."""
    if not use_chat_template:
        return f"{system_prompt}\n{example.question}" if system_prompt else example.question
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; set the task option "
                         f"use_chat_template: false to use the raw question as the prompt")
    return tokenizer.apply_chat_template(example.messages(system_prompt), add_generation_prompt=True,
                                         tokenize=False)


def prompt_token_ids(tokenizer: Any, examples: list, *, use_chat_template: bool, system_prompt: str | None,
                     max_prompt_length: int) -> list[list[int]]:
    """Token ids of the rendered prompts; one longer than `max_prompt_length` is a UserError."""
    try:
        texts = [render_prompt(tokenizer, ex, system_prompt, use_chat_template) for ex in examples]
    except ValueError as exc:  # a tokenizer without a chat template
        raise UserError(f"task.options.use_chat_template: {str(exc).rstrip('.')}; "
                        "or use a tokenizer with a chat template") from None
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for ex, row in zip(examples, ids):
        if len(row) > max_prompt_length:
            raise UserError(f"prompt of example {ex.id or ex.question[:40]!r} has {len(row)} tokens, more than "
                            f"rollout.max_prompt_length={max_prompt_length}; raise rollout.max_prompt_length")
    return [list(row) for row in ids]


def run_prompt_ids(run: Any, use_chat_template: bool, examples: list) -> list[list[int]]:
    """`prompt_token_ids` of `examples` as the built run renders prompts (its tokenizer, system
    prompt and length limit)."""
    return prompt_token_ids(run.inputs.tokenizer, examples, use_chat_template=use_chat_template,
                            system_prompt=run.cfg.task.system_prompt,
                            max_prompt_length=run.cfg.rollout.max_prompt_length)


def tokenize_prompts(run: Any, examples: list) -> list[list[int]]:
    """Token ids of training prompts: the ids checked at start where there are, else tokenized now."""
    inputs = run.inputs
    unseen = [ex for ex in examples if ex.id not in inputs.prompt_ids]
    fresh = iter(run_prompt_ids(run, inputs.task.use_chat_template, unseen))
    return [inputs.prompt_ids[ex.id] if ex.id in inputs.prompt_ids else next(fresh) for ex in examples]


def decode_completions(tokenizer: Any, result: RolloutResult) -> list[CompletionText]:
    """The completions of a rollout as reward functions and graders read them."""
    ids = host_array(result.completion_ids)
    mask = host_array(result.completion_mask).astype(bool)
    texts = tokenizer.batch_decode([row[m].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True)
    lengths, finished = host_array(result.lengths), host_array(result.finished)
    return [CompletionText(text, int(n), ids.shape[1], bool(done)) for text, n, done in zip(texts, lengths, finished)]


def with_prompts(completions: list, examples: list, n: int, system_prompt: str | None) -> list:
    """`completions`, row i of example i // n, each given its example's `question` and chat
    messages as `prompt` (grpo_core.task_contracts.CompletionText), for rewards that read the
    question (a judge) or score the prompt too (a reward model)."""
    for i, completion in enumerate(completions):
        example = examples[i // n]
        completion.question, completion.prompt = example.question, tuple(example.messages(system_prompt))
    return completions
