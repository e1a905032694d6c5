"""Load-time checks of a multi-turn run against its inputs (tokenizer, task, model): each a
UserError of one line, raised before any device work (called by build.check_inputs)."""

from __future__ import annotations

from typing import Any

from grpo_core.config import RolloutConfig
from grpo_core.errors import UserError

from grpo_runner_gsm8k.samplers.multi_turn_rollout import CALL_END, single_token_id
from grpo_runner_gsm8k.tasks.gsm8k_tools import SUGGESTED_TOOLS, Gsm8kToolsTask


def check_multi_turn_inputs(cfg: Any, tokenizer: Any, task: Any, max_positions: int) -> None:
    """What this sampler cannot run with, as a UserError (one line) before any device work."""
    if not cfg.rollout.multi_turn.enabled:
        if isinstance(task, Gsm8kToolsTask):
            raise UserError(f"task.name = {cfg.task.name!r} invites tool calls, but rollout.multi_turn.enabled is false; "
                            f"set rollout.multi_turn.enabled=true and rollout.multi_turn.tools=[{', '.join(SUGGESTED_TOOLS)}]")
        return
    if not task.use_chat_template:
        raise UserError("rollout.multi_turn.enabled with task.options.use_chat_template = false: tool turns are "
                        "rendered by the chat template; set task.options.use_chat_template=true (and use a "
                        "tokenizer with a chat template)")
    if single_token_id(tokenizer, CALL_END) is None:
        raise UserError(f"rollout.multi_turn.enabled: the tokenizer encodes {CALL_END!r} as "
                        f"{len(tokenizer.encode(CALL_END, add_special_tokens=False))} tokens, and a turn stops at "
                        "one token; use a tokenizer with Qwen's tool tokens (Qwen2.5, Qwen3; model.tokenizer=char-tools "
                        "for tiny runs)")
    longest = cfg.rollout.max_prompt_length + row_budget(cfg.rollout)
    if longest > max_positions:
        raise UserError(f"rollout.max_prompt_length + rollout.multi_turn.max_total_tokens = {longest} exceeds the "
                        f"model's max_position_embeddings {max_positions}; lower "
                        "rollout.multi_turn.max_total_tokens")


def row_budget(rollout: RolloutConfig) -> int:
    """Completion tokens of a row over all its turns."""
    return rollout.multi_turn.max_total_tokens or rollout.max_new_tokens
