"""The step's rollout batch from multi-turn, tool-using rollouts (rollout.multi_turn; the
turn loop is grpo_runner_gsm8k.samplers.multi_turn_rollout).

Prompts are rendered with the offered tools (the chat template's `tools=`). Rewards receive
a `ConversationText` per row: the final answer (the text after the last tool turn) as the
string, the whole conversation as `.conversation`. Tools are looked up by name in the
plugin registry, so the runner needs no tool package of its own.
"""

from __future__ import annotations

import time
from typing import Any

from grpo_core.chat_turns import host_conversation_ids
from grpo_core.config import MultiTurnConfig
from grpo_core.config_io import plugin_options
from grpo_core.contracts import ConversationText, KeptCacheRollout, Policy
from grpo_core.errors import UserError
from grpo_core.rollout_records import DecodeTally, Sampled, waste_metrics
from grpo_core.step_samplers import loaded
from grpo_core.tool_calls import ToolRunner, tool_schema

from grpo_runner_gsm8k.samplers.multi_turn_inputs import row_budget
from grpo_runner_gsm8k.samplers.shared_environments import reset_all
from grpo_runner_gsm8k.samplers.multi_turn_rollout import CALL_END, MultiTurnRollout, single_token_id, turn_sampling
from grpo_runner_gsm8k.multihost import gather_objects, host_array
from grpo_runner_gsm8k.tasks.base import prompts_to_check
from grpo_runner_gsm8k.training.scoring import score
from grpo_runner_gsm8k.tokens import with_prompts
from grpo_runner_gsm8k.samplers.trajectory import Trajectory, episode_arrays, trajectory_metrics, trajectory_result


def build_tools(multi: MultiTurnConfig, registry: Any) -> list:
    """The tools rollout.multi_turn offers, each built once from its plugin (names and options
    checked at load)."""
    tools = []
    for name in multi.tools:
        spec = registry.tool(str(name))
        options = plugin_options(spec.options, multi.tool_options.get(name, {}),
                                 f"rollout.multi_turn.tool_options.{name}")
        tools.append(spec.factory(options))
    return tools


def tool_prompt_ids(tokenizer: Any, openings: list, offered: list[dict], *, host_text: bool = False) -> list[list[int]]:
    """Token ids of each opening conversation rendered by the chat template with the `offered`
    tools (`ToolRunner.offered()`) and the generation prompt: a multi-turn row's prompt.
    host_text: the openings are an environment's, their text tokenized as plain text
    (grpo_core.host_text), never as control tokens."""
    if host_text:
        return [host_conversation_ids(tokenizer, messages, tools=offered) for messages in openings]
    texts = [tokenizer.apply_chat_template(messages, tools=offered, add_generation_prompt=True, tokenize=False)
             for messages in openings]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [list(row) for row in ids]


def checked_tool_prompts(tokenizer: Any, examples: list, openings: list, offered: list[dict],
                         max_prompt_length: int, *, host_text: bool = False) -> list[list[int]]:
    """`tool_prompt_ids` of the examples' openings; one longer than `max_prompt_length` is a
    UserError."""
    ids = tool_prompt_ids(tokenizer, openings, offered, host_text=host_text)
    for ex, row in zip(examples, ids):
        if len(row) > max_prompt_length:
            raise UserError(f"prompt of example {ex.id or ex.question[:40]!r} has {len(row)} tokens with the "
                            f"tools offered, more than rollout.max_prompt_length={max_prompt_length}; "
                            "raise rollout.max_prompt_length")
    return ids


def check_tool_prompts(rollout: Any, eval_cfg: Any, task_cfg: Any, inputs: Any, registry: Any) -> None:
    """Every prompt a multi-turn run without an environment can see, rendered with the offered
    tools as its sampler renders them, checked against rollout.max_prompt_length (`--print-config`;
    a run checks them when its sampler is built)."""
    if not rollout.multi_turn.enabled or rollout.multi_turn.environment is not None:
        return
    examples = prompts_to_check(eval_cfg, inputs.task, inputs.prompts_per_process)
    offered = [tool_schema(tool) for tool in build_tools(rollout.multi_turn, registry)]
    checked_tool_prompts(inputs.tokenizer, examples, [ex.messages(task_cfg.system_prompt) for ex in examples],
                         offered, rollout.max_prompt_length)


def keeps_caches(mode: str, backend: Any, backend_name: str) -> bool:
    """rollout.multi_turn.kv_cache resolved for this backend (auto: kept when it keeps caches)."""
    keeps = isinstance(backend, KeptCacheRollout)
    if mode == "kept" and not keeps:
        raise UserError(f"rollout.multi_turn.kv_cache=kept: the rollout backend {backend_name!r} has no "
                        "generate_round (rounds on a kept KV cache); set rollout.multi_turn.kv_cache=reprefill")
    return keeps if mode == "auto" else mode == "kept"


def build_environment(cfg: Any, registry: Any) -> tuple[Any, Any]:
    """(the environment's spec, its options), or (None, None) without one (checked at load)."""
    multi = cfg.rollout.multi_turn
    if multi.environment is None:
        return None, None
    spec = registry.environment(str(multi.environment))
    return spec, plugin_options(spec.options, multi.environment_options, "rollout.multi_turn.environment_options")


class ToolRows:
    """A multi-turn run's tools, environment and turn loop, each turn sampled as `sampling` says
    and each row given `budget` completion tokens: rows started from examples (prompts rendered
    with the tools offered, or environments reset) and rolled out turn by turn. Training's
    sampler and the eval (grpo_runner_gsm8k.evaluation.multi_turn) each hold their own."""

    def __init__(self, run: Any, registry: Any, sampling: Any, budget: int):
        multi, tokenizer = run.cfg.rollout.multi_turn, run.inputs.tokenizer
        self.run = run
        kv_cache = keeps_caches(multi.kv_cache, run.rollout, run.cfg.rollout.backend)
        call_end = single_token_id(tokenizer, CALL_END)  # checked at load (check_multi_turn_inputs)
        self.runner = ToolRunner(build_tools(multi, registry), timeout_seconds=multi.call_timeout_s)
        self.turns = MultiTurnRollout(
            backend=run.rollout, tokenizer=tokenizer, runner=self.runner,
            sampling=turn_sampling(sampling, call_end), call_end_id=call_end, max_turns=multi.max_turns,
            budget=budget, pad_token_id=tokenizer.pad_token_id, batch_sharding=run.rollout_sharding,
            kv_cache=kv_cache)
        self.environment, self.environment_options = build_environment(run.cfg, registry)

    def render(self, examples: list, openings: list | None = None) -> list[list[int]]:
        """The examples' prompts (or an environment's `openings`, one per example, tokenized as
        plain text) rendered with the offered tools; too long is a UserError."""
        cfg = self.run.cfg
        host_text = openings is not None
        openings = openings if host_text else [ex.messages(cfg.task.system_prompt) for ex in examples]
        return checked_tool_prompts(self.run.inputs.tokenizer, examples, openings, self.runner.offered(),
                                    cfg.rollout.max_prompt_length, host_text=host_text)

    def prompt_ids(self, examples: list) -> list[list[int]]:
        """Token ids of the examples' prompts."""
        return self.render(examples)

    def start_rows(self, examples: list, n: int) -> tuple[list[list[int]], list | None]:
        """(each row's prompt ids, each row's environment reset on its example (on process 0: see
        grpo_runner_gsm8k.samplers.shared_environments), or None)."""
        if self.environment is None:
            return [ids for ids in self.prompt_ids(examples) for _ in range(n)], None
        repeated = [ex for ex in examples for _ in range(n)]
        openings, environments = reset_all(self.environment, self.environment_options, repeated)
        return self.render(repeated, openings), environments

    def rolled_out(self, policy: Policy, examples: list, n: int, key: Any) -> tuple[list[Trajectory], DecodeTally]:
        """(n rows per example, rows p*n .. p*n+n-1 of example p, each run to its end with `policy`
        loaded; the decode work they took)."""
        prompts, environments = self.start_rows(examples, n)
        with loaded(self.run.rollout, policy):
            return self.turns.rollout(prompts, 1, key, environments)


class MultiTurnSampler(ToolRows):
    """Owns the run's tools; `sample` gives one step's rows, scored (a `StepSampler`, made by
    grpo_runner_gsm8k.samplers.factory.step_sampler)."""

    def __init__(self, run: Any, registry: Any):
        super().__init__(run, registry, run.sampling, row_budget(run.cfg.rollout))
        self.step_rows: list[Trajectory] = []  # rolled out since the last step_metrics
        # Every prompt the run can see, rendered with the tools, so one too long fails now, not mid-run
        # (an environment writes its rows' prompts as it starts them: checked then).
        examples = [] if self.environment else prompts_to_check(run.cfg.eval, run.inputs.task,
                                                                 run.inputs.prompts_per_process)
        try:
            self.checked = {ex.id: ids for ex, ids in zip(examples, self.render(examples)) if ex.id}
        except UserError:
            self.runner.close()
            raise

    def prompt_ids(self, examples: list) -> list[list[int]]:
        """Token ids of the prompts: those checked at start where there are, else rendered now."""
        unseen = [ex for ex in examples if ex.id not in self.checked]
        fresh = iter(self.render(unseen))
        return [self.checked[ex.id] if ex.id in self.checked else next(fresh) for ex in examples]

    def sample(self, policy: Policy, key: Any, step: int) -> tuple[Sampled, dict, dict[str, float]]:
        """(this step's rows scored, the tool and decode-waste metrics of the step, its seconds)."""
        sampled, work, seconds = self.scored_rollout(policy, key)
        return sampled, {**self.step_metrics(), **waste_metrics(work, host_array(sampled.result.lengths))}, seconds

    def scored_rollout(self, policy: Policy, key: Any) -> tuple[Sampled, DecodeTally, dict[str, float]]:
        """(fresh prompts rolled out turn by turn and scored, the decode work, its seconds); the
        rows count in `step_metrics` (the refill sampler calls this once per rollout)."""
        start = time.monotonic()
        run, n = self.run, self.run.cfg.rollout.n
        examples = gather_objects(run.inputs.task.train_batch(run.inputs.prompts_per_process))
        rows, work = self.rolled_out(policy, examples, n, key)
        reward_start = time.monotonic()
        result = trajectory_result(rows, n, self.turns.budget, run.inputs.tokenizer.pad_token_id)
        answers = [ex.answer for ex in examples for _ in range(n)]
        texts = with_prompts(conversation_texts(run.inputs.tokenizer, rows, self.turns.budget), examples, n,
                             run.cfg.task.system_prompt)
        scores = score(run.inputs.rewards, texts, answers)
        scores = scores._replace(episodes=episode_arrays(rows, self.turns.budget))
        self.step_rows += rows
        seconds = {"rollout_s": reward_start - start, "reward_s": time.monotonic() - reward_start}
        return Sampled(examples, result, scores), work, seconds

    def step_metrics(self) -> dict:
        """The tool metrics of every row rolled out since the last call (train-tools/*)."""
        rows, self.step_rows = self.step_rows, []
        return trajectory_metrics(rows)


def conversation_texts(tokenizer: Any, rows: list[Trajectory], budget: int) -> list[ConversationText]:
    """What the rewards receive of each row: the final answer, and the whole conversation."""
    answers = tokenizer.batch_decode([row.answer_ids for row in rows], skip_special_tokens=True)
    conversations = tokenizer.batch_decode([row.ids for row in rows], skip_special_tokens=False)
    return [ConversationText(answer, sum(row.trained), budget, row.finished, conversation=conversation,
                             turns=row.turns, tool_calls=row.tool_calls,
                             environment=row.environment.reward_info() if row.environment is not None else None)
            for answer, conversation, row in zip(answers, conversations, rows)]
