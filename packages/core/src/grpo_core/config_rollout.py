"""The rollout section's own sub-sections (`rollout.partial`, `rollout.multi_turn`) of the run
configuration (`grpo_core.config`, which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from grpo_core.config_fields import setting


@dataclass(frozen=True)
class PartialConfig:
    """Partial rollouts: decode slots never wait for the longest row (see grpo_rollout.partial)."""

    enabled: bool = setting(
        False, "Decode at most `budget` steps per round; rows still running are carried into the next step "
        "(see kv_cache), and a group enters the update once all its rows are done. Needs "
        "loss.mismatch_correction (carried tokens come from older policies). Eval never uses it.")
    # A quarter of the longest completion: a row of max_new_tokens spans at most four rounds.
    budget: Optional[int] = setting(
        None, "Decode steps per round; null = ceil(rollout.max_new_tokens / 4) (filled in at load).", ge=1)
    max_staleness: Optional[int] = setting(
        None, "Restart a running row whose first token is more than this many policy versions (steps) old; "
        "null = never. At least ceil(max_new_tokens / budget) - 1, or the longest rows could never finish.", ge=0)
    budget_quantile: Optional[float] = setting(
        None, "Decode steps per round from the lengths of the last prompts_per_step x n trained rows: their "
        "quantile q, rounded up to a power of two (few compiled lengths), at most `budget`; null = always `budget`.",
        gt=0.0, le=1.0)
    # More slots than a step's rows: fewer, wider rounds per step (decode reads the weights once per
    # token for every slot), rows carried longer.
    slots: Union[int, Literal["auto"], None] = setting(
        None, "Decode slots (rows in flight): null = rollout.prompts_per_step x rollout.n; an integer multiple "
        "of that; auto = the count of 1, 2 or 4 times it whose projected step is fastest among those that fit "
        "the device memory, decided by `grpo-run --plan --target` and by a run on TPU chips of a known "
        "generation (elsewhere 1 time). A step whose groups are already complete decodes nothing.", ge=1)
    kv_cache: Literal["auto", "reprefill", "within_step", "across_steps"] = setting(
        "auto", "How a running row continues in the next round: auto = within_step when the rollout backend keeps "
        "caches (the built-in one does), else reprefill; reprefill = its prompt and tokens so far "
        "prefilled again; within_step = its KV cache kept between the rounds of a step (same weights) and "
        "re-prefilled under the new weights at the next step; across_steps = kept also across updates (keys and "
        "values of older weights; held through the update; not saved, so a resumed run re-prefills once and "
        "continues, not bitwise).")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollouts: the policy calls tools in the Qwen format and continues (see docs/tools.md)."""

    enabled: bool = setting(
        False, "Decode each row until a stop token or `</tool_call>`, run the calls, append the tool turn's "
        "template tokens (loss mask 0) and continue, up to max_turns. Needs a tokenizer with a chat template "
        "and `</tool_call>` as one token.")
    tools: list = setting([], "Tool plugin names offered to the policy (through the chat template's tools=).")
    tool_options: dict = setting({}, "Options of each offered tool, by name (validated by the tool's plugin).")
    environment: Optional[str] = setting(
        None, "Environment plugin name: one per row, it opens the conversation (reset) and answers each "
        "assistant turn that calls no tool (step), until it is done; null = none.")
    environment_options: dict = setting({}, "Options of the environment (validated by its plugin).")
    max_turns: int = setting(4, "Assistant turns per row at most; a row that still calls a tool then stops.", ge=1)
    # null keeps the update's completion width at rollout.max_new_tokens, as without tools.
    max_total_tokens: Optional[int] = setting(
        None, "Completion tokens per row over all turns, tool turns included (each turn samples at most "
        "rollout.max_new_tokens of them); null = rollout.max_new_tokens.", ge=1)
    call_timeout_s: float = setting(30.0, "Wall-clock seconds of one tool call; past it the model reads a "
                                    "timeout error.", gt=0.0)
    kv_cache: Literal["auto", "kept", "reprefill"] = setting(
        "auto", "kept = each row continues on its KV cache after a tool turn (only the tool turn's tokens are "
        "run in) and rows waiting on a tool hold up no other row; reprefill = every turn prefills the whole "
        "conversation again, once every call of the turn has returned; auto = kept when the rollout backend "
        "keeps caches (generate_round).")
