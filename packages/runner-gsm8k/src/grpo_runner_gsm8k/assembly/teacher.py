"""The teacher of on-policy distillation (`teacher:`): checked, loaded, placed, and scoring.

The teacher is a frozen HF model of its own (its own architecture and dtype), apart from the
policy and from the reference model of loss.beta > 0 (with LoRA the reference is the student's
base without adapters; the teacher never is). It is sharded over the mesh by the policy's
parameter rules (`placement: sharded`), or copied whole onto every device (`replicated`). After
each rollout it scores every sampled token with the run's loss implementation (the same fused,
vocabulary-blocked scorer as old and reference log-probs), and the scores become token-level
advantages (the math: grpo_losses.distillation). With `teacher.estimator: full` it computes its
final hidden states at the completion positions instead, and the update adds the exact reverse KL
over the whole vocabulary through the teacher's LM head (grpo_losses.full_kl).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from grpo_core.config import ModelConfig, RolloutConfig, TeacherConfig
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig, load_pretrained
from grpo_core.models.attention_impls import resolve_attention
from grpo_core.models.presets import hub_architecture
from grpo_core.models.hf_io import abstract_model, resolve_model_dir
from grpo_core.models.qwen import resolve_dtype
from grpo_core.sharding import param_shardings
from grpo_core.tokenizer import load_tokenizer
from grpo_losses.distillation import distillation_advantages, mean_reverse_kl
from grpo_losses.full_kl import FullKLTerm

from grpo_runner_gsm8k.samplers.multi_turn_inputs import row_budget
from grpo_runner_gsm8k.training.step import make_completion_hidden, make_score

TEACHER_PHASE = "teacher log-probs"  # the name of its scoring phase in memory checks and the plan


@dataclass(frozen=True)
class Teacher:
    """qcfg: the teacher's architecture; params (real or, in the plan, abstract) are stored in
    teacher.dtype and placed as teacher.placement says; score: grpo_runner_gsm8k.training.step.make_score
    of the teacher's graphdef; hidden: ...step.make_completion_hidden of it; head: its LM head [H, V]
    (the untied head's own array, or, for a tied embedding, its transpose: one embedding-sized copy)."""

    qcfg: QwenConfig
    graphdef: nnx.GraphDef
    params: Any
    score: Callable[..., jax.Array]
    hidden: Callable[..., jax.Array]
    head: Any


def full_kl_term(teacher: TeacherConfig) -> Optional[FullKLTerm]:
    """The exact-KL term of the update (`estimator: full`: teacher.coef and teacher.divergence), else None."""
    return FullKLTerm(teacher.coef, teacher.divergence) if teacher.path and teacher.estimator == "full" else None


def teacher_head(graphdef: nnx.GraphDef, params: Any) -> Any:
    """The LM head [H, V] of the teacher's params (abstract params give its shape and dtype)."""
    head = lambda p: nnx.merge(graphdef, p).lm_head_weight()  # noqa: E731
    if all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params)):
        return head(params)
    return jax.eval_shape(head, params)


def teacher_error(exc: Exception, fix: str) -> UserError:
    return UserError(f"teacher.path: {str(exc).rstrip('.')}; {fix}")


def teacher_architecture(teacher: TeacherConfig, planning: bool = False) -> QwenConfig:
    """The teacher's model config from its config.json; the plan also takes a Hub id whose
    architecture is built in (no download)."""
    path = teacher.path
    if planning and not os.path.isdir(path) and hub_architecture(path) is not None:
        return hub_architecture(path)
    try:
        return QwenConfig.from_pretrained_dir(resolve_model_dir(path))
    except (OSError, ValueError) as exc:
        raise teacher_error(exc, "point teacher.path at an HF model directory (config.json + *.safetensors) "
                                 "or a Hub id") from None


def first_vocabulary_difference(student: Any, teacher: Any) -> Optional[tuple[int, Optional[str], Optional[str]]]:
    """(id, student's token, teacher's token) at the lowest id where the vocabularies differ
    (None for a token the tokenizer lacks), or None when they are the same."""
    student_tokens = {i: token for token, i in student.get_vocab().items()}
    teacher_tokens = {i: token for token, i in teacher.get_vocab().items()}
    for token_id in sorted(student_tokens.keys() | teacher_tokens.keys()):
        if student_tokens.get(token_id) != teacher_tokens.get(token_id):
            return token_id, student_tokens.get(token_id), teacher_tokens.get(token_id)
    return None


def check_teacher_tokenizer(teacher: TeacherConfig, student_tokenizer: Any) -> None:
    """The teacher scores the student's token ids, so both must mean the same token by each id."""
    try:
        teacher_tokenizer = load_tokenizer(resolve_model_dir(teacher.path))
    except (OSError, ValueError) as exc:
        raise teacher_error(exc, "point teacher.path at an HF model directory with tokenizer files") from None
    diff = first_vocabulary_difference(student_tokenizer, teacher_tokenizer)
    if diff is not None:
        token_id, ours, theirs = diff
        raise UserError(f"teacher.path {teacher.path!r}: the teacher's tokenizer differs from the student's "
                        f"first at id {token_id} (student {ours!r}, teacher {theirs!r}); the teacher scores the "
                        "student's token ids, so use a teacher with the student's tokenizer (the same model family)")
    qcfg = teacher_architecture(teacher)
    try:
        qcfg.check_tokenizer_fits(len(student_tokenizer), "use a teacher whose embedding covers the tokenizer")
    except ValueError as exc:
        raise teacher_error(exc, "or pick another teacher") from None


def check_teacher_positions(teacher: TeacherConfig, rollout: RolloutConfig) -> None:
    """The teacher scores whole training rows (prompt + completion), so its context must hold them,
    as the student's must (build.check_lengths)."""
    completion_key, completion = "rollout.max_new_tokens", rollout.max_new_tokens
    if rollout.multi_turn.enabled:
        completion_key, completion = "rollout.multi_turn.max_total_tokens", row_budget(rollout)
    longest, positions = rollout.max_prompt_length + completion, teacher_architecture(teacher).max_position_embeddings
    if longest > positions:
        raise UserError(f"teacher.path {teacher.path!r}: rollout.max_prompt_length + {completion_key} = "
                        f"{rollout.max_prompt_length} + {completion} = {longest} exceeds the teacher's "
                        f"max_position_embeddings {positions}; lower {completion_key} or rollout.max_prompt_length, "
                        "or use a teacher with a longer context")


def teacher_rules(teacher: TeacherConfig, strategy: Any) -> list:
    """The policy's parameter rules (sharded), or every logical axis on no mesh axis (replicated)."""
    if teacher.placement == "sharded":
        return list(strategy.param_rules)
    return [(name, None) for name, _ in strategy.param_rules]


def prepare_frozen_model(model: Any, attention: str, dtype: str, mesh: Mesh, strategy: Any, owner: str,
                         dtype_key: str) -> Any:
    """`model` (a frozen teacher, judge or reward model) with the policy's activation sharding and
    `attention` (model.attention) for its own `dtype`; `owner` and `dtype_key` name it in the error."""
    model.set_activation_sharding(mesh, strategy.activation_rules)
    try:
        model.set_attention(resolve_attention(attention, dtype, mesh.devices.flat[0].platform))
    except ValueError as exc:
        raise UserError(f"model.attention for the {owner}: {exc}; or set {dtype_key}=bfloat16") from None
    return model


def load_teacher(teacher: TeacherConfig, model_cfg: ModelConfig, mesh: Mesh, strategy: Any, loss_impl: Any,
                 temperature: float) -> Teacher:
    """The teacher's weights straight onto the mesh in teacher.dtype (frozen: only run forward),
    laid out (model.scan_layers) and attending (model.attention) as the policy does; it scores
    at the sampling `temperature`."""
    try:
        model = load_pretrained(teacher.path, dtype=teacher.dtype, mesh=mesh,
                                rules=teacher_rules(teacher, strategy), scan_layers=model_cfg.scan_layers)
    except (OSError, ValueError) as exc:
        raise teacher_error(exc, "re-download or re-export the teacher") from None
    model = prepare_frozen_model(model, model_cfg.attention, teacher.dtype, mesh, strategy, "teacher", "teacher.dtype")
    graphdef, params = nnx.split(model)
    return Teacher(model.config, graphdef, params, make_score(graphdef, loss_impl, temperature),
                   make_completion_hidden(graphdef), teacher_head(graphdef, params))


def abstract_teacher(teacher: TeacherConfig, model_cfg: ModelConfig, mesh: Mesh, strategy: Any, loss_impl: Any,
                     temperature: float) -> Teacher:
    """The plan's teacher: its params as sharded shapes only, placed as load_teacher places them."""
    qcfg = teacher_architecture(teacher, planning=True)
    model = prepare_frozen_model(abstract_model(qcfg, resolve_dtype(teacher.dtype), "none", model_cfg.scan_layers),
                                 model_cfg.attention, teacher.dtype, mesh, strategy, "teacher", "teacher.dtype")
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh, teacher_rules(teacher, strategy))
    params = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                          state, shardings)
    return Teacher(qcfg, graphdef, params, make_score(graphdef, loss_impl, temperature),
                   make_completion_hidden(graphdef), teacher_head(graphdef, params))


class TeacherScoring:
    """The loop's side of distillation: scores a batch with the teacher and turns the scores
    into token-level advantages; `check(name, jitted, *args, **kw)` is the run's memory check."""

    def __init__(self, teacher: Teacher, teacher_cfg: TeacherConfig, group_size: int, check: Callable[..., None]):
        """group_size: rollout.n, the rows of one prompt's group (for teacher.baseline)."""
        self.teacher, self.cfg, self.check = teacher, teacher_cfg, check
        self.baseline_group_size = group_size if teacher_cfg.baseline == "leave_one_out" else None

    def logps(self, input_ids, attention_mask, targets, width: int) -> jax.Array:
        """log q of every target token [N, C] float32, at the sampling temperature."""
        args = (self.teacher.params, input_ids, attention_mask, targets)
        self.check(TEACHER_PHASE, self.teacher.score, *args, prompt_width=width)
        return self.teacher.score(*args, prompt_width=width)

    def update_inputs(self, row_advantages, sampler_logp, mask, input_ids, attention_mask, targets,
                      width: int) -> tuple[jax.Array, dict, dict]:
        """(the update's advantages, the UpdateBatch fields of the teacher, metrics) of either estimator."""
        if self.cfg.estimator == "sampled":
            advantages, metrics = self.advantages(row_advantages, sampler_logp, mask, input_ids, attention_mask,
                                                  targets, width)
            return advantages, {}, metrics
        args = (self.teacher.params, input_ids, attention_mask)
        self.check(TEACHER_PHASE, self.teacher.hidden, *args, prompt_width=width)
        hidden = self.teacher.hidden(*args, prompt_width=width)
        advantages = row_advantages if self.cfg.use_task_reward else jnp.zeros_like(row_advantages)
        return advantages, {"teacher_hidden": hidden, "teacher_head": self.teacher.head}, {}

    def advantages(self, row_advantages, sampler_logp, mask, input_ids, attention_mask, targets,
                   width: int) -> tuple[jax.Array, dict]:
        """(A_t [N, C] of grpo_losses.distillation, its metrics); `sampler_logp` [N, C] are the
        student's log-probs (see that module for why the sampler's)."""
        teacher_logp = self.logps(input_ids, attention_mask, targets, width)
        advantages = distillation_advantages(row_advantages, sampler_logp, teacher_logp, mask, self.cfg.coef,
                                             self.cfg.use_task_reward, self.baseline_group_size)
        return advantages, {"train-other/distill_reverse_kl": float(mean_reverse_kl(sampler_logp, teacher_logp, mask))}
