"""The local judge of the `judge` reward (`task.reward_options.judge.path`): loaded onto the run's
mesh like the teacher (its own architecture and dtype, the policy's parameter rules), and decoded
greedily by the run's own rollout backend, `max_tokens` new tokens at most, after the policy's
rollout has released its weights (rewards are scored after it).

A judge prompt that leaves no room for `max_tokens` in the judge's context gets no reply (None:
the reward scores it 0 and counts an error). The batch is padded with copies of its last prompt to
a multiple of the rollout's data-parallel shards, as the backend's batch sharding needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from grpo_core.config import ModelConfig, RolloutConfig
from grpo_core.contracts import Policy, RolloutBackend, SamplingParams, loaded
from grpo_core.errors import UserError
from grpo_core.models import load_pretrained
from grpo_core.models.hf_io import resolve_model_dir
from grpo_core.tokenizer import load_tokenizer
from grpo_meshes import rollout_batch_sharding

from grpo_runner_gsm8k.assembly.teacher import prepare_frozen_model
from grpo_runner_gsm8k.samplers.multi_turn_rollout import data_shards
from grpo_runner_gsm8k.tasks.judge import JudgeOptions, JudgeReward, LocalClient
from grpo_runner_gsm8k.tokens import decode_completions


@dataclass
class JudgeDecoder:
    """`decoder(users)` -> the judge model's greedy reply to each user message (None: too long)."""

    policy: Policy
    tokenizer: Any
    backend: RolloutBackend
    sampling: SamplingParams
    sharding: NamedSharding
    system_prompt: str

    def prompt_ids(self, user: str) -> list[int]:
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
            {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def __call__(self, users: Sequence[str]) -> list[Optional[str]]:
        room = self.policy.config.max_position_embeddings - self.sampling.max_new_tokens
        prompts = [self.prompt_ids(user) for user in users]
        fitting = [i for i, ids in enumerate(prompts) if len(ids) <= room]
        replies: list[Optional[str]] = [None] * len(users)
        if fitting:
            for i, text in zip(fitting, self.decode([prompts[i] for i in fitting])):
                replies[i] = text
        return replies

    def decode(self, prompts: list[list[int]]) -> list[str]:
        shards = data_shards(self.sharding)
        padded = prompts + [prompts[-1]] * (-len(prompts) % shards)
        with loaded(self.backend, self.policy) as backend:
            result = backend.generate(padded, jax.random.key(0), self.sampling,
                                      pad_token_id=self.tokenizer.pad_token_id, batch_sharding=self.sharding)
        return [str(text) for text in decode_completions(self.tokenizer, result)[:len(prompts)]]


def judge_stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The judge's end-of-turn tokens: its eos, and ChatML's <|im_end|> where the vocabulary has it."""
    ids = {tokenizer.eos_token_id, tokenizer.get_vocab().get("<|im_end|>")}
    return tuple(sorted(ids - {None}))


def load_judge(options: JudgeOptions, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, mesh: Mesh, strategy: Any,
               backend: RolloutBackend) -> JudgeDecoder:
    """The judge's weights onto the mesh in options.dtype (laid out and attending as the policy does)."""
    try:
        tokenizer = load_tokenizer(resolve_model_dir(options.path))
        model = load_pretrained(options.path, dtype=options.dtype, mesh=mesh, rules=list(strategy.param_rules),
                                scan_layers=model_cfg.scan_layers)
    except (OSError, ValueError) as exc:
        raise UserError(f"task.reward_options.judge.path {options.path!r}: {str(exc).rstrip('.')}; point it at an HF "
                        "model directory (config.json, *.safetensors, tokenizer files) or a Hub id") from None
    model = prepare_frozen_model(model, model_cfg.attention, options.dtype, mesh, strategy, "judge",
                                 "task.reward_options.judge.dtype")
    sampling = SamplingParams(max_new_tokens=options.max_tokens, greedy=True, stop_token_ids=judge_stop_ids(tokenizer))
    return JudgeDecoder(Policy.of(model), tokenizer, backend, sampling,
                        rollout_batch_sharding(mesh, rollout_cfg.sharding), options.system_prompt)


def attach_local_judges(rewards: dict[str, tuple[Any, float]], model_cfg: ModelConfig, rollout_cfg: RolloutConfig,
                        mesh: Mesh, strategy: Any, backend: RolloutBackend) -> None:
    """Loads the model of every local `judge` reward among `rewards` and hands it its decoder."""
    for fn, _ in rewards.values():
        if isinstance(fn, JudgeReward) and isinstance(fn.client, LocalClient):
            fn.client.decode = load_judge(fn.options, model_cfg, rollout_cfg, mesh, strategy, backend)
