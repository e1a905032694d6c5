"""The `reward_model` reward: a sequence-classification reward model's scalar score of each
(prompt, completion), weighted and logged like any reward.

The host side lives here: the conversation each completion is scored as (the reward model's own
tokenizer and chat template), cut to `max_length`, batched and right-padded with the model's
pad id. The device side (the weights on the run's mesh, the jitted forward) is
grpo_runner_gsm8k.assembly.reward_model, which places a `Scorer` into the reward once the mesh
exists; the score rule is grpo_core.models.sequence_scores (transformers' own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import numpy as np
from grpo_core import RewardSpec
from grpo_core.config import setting
from grpo_core.errors import UserError
from grpo_core.models.hf_io import resolve_model_dir
from grpo_core.models.sequence_scores import ScoreHead, last_scored_token
from grpo_core.tokenizer import load_tokenizer

from grpo_runner_gsm8k.tasks.rewards import check_pairs

REWARD_MODEL = "reward_model"  # the reward's name in task.rewards and task.reward_options
SHORTEST_BUCKET = 16  # the narrowest padded width: fewer compiled shapes for short conversations

# (input_ids [B, T], attention_mask [B, T], scored position [B]) -> scores [B] (host arrays)
Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class RewardModelOptions:
    """Options of the `reward_model` reward (task.reward_options.reward_model)."""

    path: str = setting("", "HF directory or Hub id of a *ForSequenceClassification checkpoint of a supported "
                        "family: config.json (num_labels 1), safetensors with score.weight [1, hidden], tokenizer.")
    dtype: Literal["float32", "bfloat16"] = setting(
        "bfloat16", "The reward model's weights and forward (float32 for scores exactly as transformers' in f32).")
    batch_size: int = setting(16, "Conversations per forward, rounded up to a multiple of the mesh's data "
                              "shards; the step's completions are scored in batches of this size.", ge=1)
    max_length: Optional[int] = setting(
        None, "Longest conversation scored, in the reward model's tokens; a longer one keeps its last max_length "
        "tokens (counted in truncated). null = the model's max_position_embeddings (the plan's width).", ge=1)
    use_chat_template: bool = setting(
        True, "Score [system, user, assistant: completion] rendered with the reward model's chat template; false: "
        "the question, `separator` and the completion as plain text (with the tokenizer's special tokens).")
    separator: str = setting("\n", "Between question and completion when use_chat_template is false.")

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path is empty; set it to the reward model's HF directory or Hub id")


def reward_model_error(options: RewardModelOptions, exc: Exception, fix: str) -> UserError:
    key = f"task.reward_options.{REWARD_MODEL}.path"
    return UserError(f"{key} {options.path!r}: {' '.join(str(exc).split()).rstrip('.')}; {fix}")


def read_reward_model(options: RewardModelOptions) -> tuple[str, ScoreHead]:
    """(local directory, score head) of options.path, refused in one line when it is no reward model."""
    try:
        model_dir = resolve_model_dir(options.path)
        return model_dir, ScoreHead.read(model_dir)
    except (OSError, ValueError) as exc:
        raise reward_model_error(options, exc, "use an HF *ForSequenceClassification checkpoint of a supported "
                                 "family with num_labels 1") from None


def scored_length(options: RewardModelOptions, head: ScoreHead) -> int:
    """The widest conversation the run scores (max_length, at most the model's context)."""
    return min(options.max_length or head.decoder.max_position_embeddings, head.decoder.max_position_embeddings)


def bucket(length: int, cap: int) -> int:
    """A padded width for `length` tokens: the next power of two (at least SHORTEST_BUCKET), at most `cap`."""
    return min(max(SHORTEST_BUCKET, 1 << max(length - 1, 0).bit_length()), cap)


class RewardModelReward:
    """`fn(completions, answers)` -> each completion's reward-model score with its prompt
    (`CompletionText.prompt`); scores only after `place` gave it the device side."""

    def __init__(self, options: RewardModelOptions):
        self.options = options
        self.model_dir, self.head = read_reward_model(options)
        self.tokenizer = self.load_tokenizer()
        self.max_length = scored_length(options, self.head)
        self.scorer: Optional[Scorer] = None
        self.rows = options.batch_size  # rows per forward, once placed a multiple of the data shards
        self.truncated, self.seconds = 0, 0.0

    def load_tokenizer(self):
        try:
            tokenizer = load_tokenizer(self.model_dir, padding_side="right")
            self.head.decoder.check_tokenizer_fits(len(tokenizer), "use the reward model's own tokenizer files")
        except (OSError, ValueError) as exc:
            raise reward_model_error(self.options, exc, "the reward model's directory needs its tokenizer") from None
        if self.options.use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise UserError(f"task.reward_options.{REWARD_MODEL}.use_chat_template is true but the reward model's "
                            f"tokenizer in {self.model_dir!r} has no chat template; set use_chat_template: false")
        return tokenizer

    def place(self, scorer: Scorer, rows: int) -> None:
        """Gives the reward its device side: `scorer` runs batches of `rows` conversations."""
        self.scorer, self.rows = scorer, rows

    def __call__(self, completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        if self.scorer is None:
            raise RuntimeError("the reward model is not on the mesh yet (assembly.reward_model places it)")
        start = time.monotonic()
        ids = [self.conversation_ids(c) for c in completions]
        scores = [s for i in range(0, len(ids), self.rows) for s in self.score_batch(ids[i:i + self.rows])]
        self.seconds += time.monotonic() - start
        return scores

    def conversation_ids(self, completion: str) -> list[int]:
        """The reward model's token ids of the completion's conversation, its last max_length kept."""
        ids = conversation_ids(self.tokenizer, getattr(completion, "prompt", ()), str(completion), self.options)
        if len(ids) > self.max_length:
            self.truncated += 1
            ids = ids[-self.max_length:]
        return ids

    def score_batch(self, rows: Sequence[list[int]]) -> list[float]:
        ids, mask = padded_batch(rows, self.rows, bucket(max(map(len, rows)), self.max_length), self.pad_id)
        scores = self.scorer(ids, mask, last_scored_token(ids, mask, self.head.pad_token_id))
        return [float(s) for s in np.asarray(scores)[:len(rows)]]

    @property
    def pad_id(self) -> int:
        """The id that fills padding: the model's pad id (transformers' rule finds a row's end by it)."""
        pad = self.head.pad_token_id
        return pad if pad is not None else (self.tokenizer.pad_token_id or 0)

    def take_metrics(self) -> dict[str, float]:
        """Conversations cut to max_length and scoring seconds since the last call."""
        out = {"truncated": float(self.truncated), "seconds": self.seconds}
        self.truncated, self.seconds = 0, 0.0
        return out


def conversation_ids(tokenizer, prompt: Sequence[dict], completion: str, options: RewardModelOptions) -> list[int]:
    """Token ids of [prompt..., assistant: completion] by the reward model's chat template, or of
    the question, separator and completion as plain text; ValueError without a prompt."""
    if not prompt:
        raise ValueError("the reward model scores a completion with its prompt, and this completion has none")
    if options.use_chat_template:
        messages = [*prompt, {"role": "assistant", "content": completion}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    question = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    return list(tokenizer(question + options.separator + completion)["input_ids"])


def padded_batch(rows: Sequence[list[int]], size: int, width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) [size, width], right-padded with `pad_id`; rows past len(rows)
    fill the batch with one real pad token each (scored, then dropped)."""
    ids = np.full((size, width), pad_id, np.int32)
    mask = np.zeros((size, width), np.int32)
    mask[len(rows):, 0] = 1
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return ids, mask


REWARD_MODEL_SPECS = [
    RewardSpec(REWARD_MODEL, RewardModelReward, RewardModelOptions,
               "a sequence-classification reward model's scalar score of (prompt, completion), run on the mesh"),
]
