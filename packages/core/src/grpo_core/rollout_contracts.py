"""What the runner asks of a rollout backend (built by `RolloutSpec.factory(options)`): the
sampling settings, the policy it samples from, the backend protocol and its optional members
(kept-cache rounds, planning, memory checks, projected decode layouts). Importable from
`grpo_core.contracts` like every other contract."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import jax
from jax.sharding import NamedSharding

from grpo_core.rollout_records import RolloutResult, TrainBatch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled (hashable: it is a static argument of the jitted loop).

    max_new_tokens:  sampled tokens per completion at most.
    n:               samples per prompt (K, the GRPO group size); rows p*n .. p*n+n-1
                     of the result belong to prompt p.
    temperature:     logits are divided by it; logps are at this temperature too.
    top_p, top_k:    nucleus mass (1.0 = off) and top-k count (0 = off); top-k is
                     applied first, top-p then acts on the top-k distribution (HF order).
    greedy:          argmax (first index on ties); temperature still sets the logps.
    stop_token_ids:  a row ends after sampling any of these (the stop token is kept and
                     counted in the completion mask).
    filtered_logps:  return log-probs of the filtered distribution instead of the
                     unfiltered log_softmax(logits / T).
    record_routing:  a mixture-of-experts model's rollout records the experts each completion
                     token was routed to (RolloutResult.experts; routing replay).
    """

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    filtered_logps: bool = False
    record_routing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "use at least 1")
        _check(self.n >= 1, "n", self.n, "use at least 1 sample per prompt")
        _check(self.temperature > 0, "temperature", self.temperature, "use > 0 (greedy=True for argmax)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "use a value in (0, 1]; 1.0 disables")
        _check(self.top_k >= 0, "top_k", self.top_k, "use >= 0; 0 disables")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "token ids are non-negative")

    @classmethod
    def from_config(cls, rollout: Any, stop_token_ids=(), **changes: Any) -> "SamplingParams":
        """From a `grpo_core.config.RolloutConfig`; `changes` override fields (e.g. for eval)."""
        params = cls(
            max_new_tokens=rollout.max_new_tokens, n=rollout.n, temperature=rollout.temperature,
            top_p=rollout.top_p, top_k=rollout.top_k, greedy=rollout.greedy,
            stop_token_ids=tuple(stop_token_ids),
        )
        return dataclasses.replace(params, **changes)

    @property
    def mode(self) -> str:
        """Which sampler runs: greedy | top_k | top_p | full."""
        if self.greedy:
            return "greedy"
        if self.top_k:
            return "top_k"
        return "top_p" if self.top_p < 1.0 else "full"


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {fix}.")


@dataclass(frozen=True)
class Policy:
    """The weights a rollout samples from, in the compute dtype and sharded like the run's
    params: a flax nnx `graphdef` and its `weights` (an nnx State; `module()` merges them),
    and the architecture `config` (a `grpo_core.models.QwenConfig`). A backend outside JAX
    reads the weights by name through `grpo_core.models.hf_names`."""

    graphdef: Any
    weights: Any
    config: Any

    @classmethod
    def of(cls, model: Any) -> "Policy":
        """The policy of a `grpo_core.models` model (its arrays are shared, not copied)."""
        from flax import nnx

        graphdef, weights = nnx.split(model)
        return cls(graphdef, weights, model.config)

    def module(self) -> Any:
        from flax import nnx

        return nnx.merge(self.graphdef, self.weights)


@runtime_checkable
class RolloutBackend(Protocol):
    """A sampler the loop drives (built by `RolloutSpec.factory(options)`).

    For each rollout (the training rollout of every update, and eval) the loop calls
    `load_weights` with the current policy, `generate`, then `release_weights` before the
    update (which needs that memory); `trim` then turns the result into the training batch.
    """

    def load_weights(self, policy: Policy) -> None:
        """The policy to sample from until the next call."""

    def release_weights(self) -> None:
        """Drop every reference to the loaded weights (a colocated engine may also free
        its own copy or KV memory); the next `load_weights` brings the updated policy."""

    def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array, sampling: SamplingParams, *,
                 pad_token_id: int = 0, batch_sharding: NamedSharding | None = None) -> RolloutResult:
        """`sampling.n` completions for each prompt (unpadded token-id lists; with several
        processes every process passes the same global list). Rows p*n .. p*n+n-1 of the
        result come from prompt p. `batch_sharding` is the NamedSharding of the [P * n, ...]
        batch (dimension 0 over the data axes of the mesh) or None."""

    def trim(self, result: RolloutResult) -> TrainBatch:
        """Prompt and completion joined into one left-padded training batch
        (`grpo_core.rollout_records.trim_batch` does it for any result)."""


@dataclass(frozen=True)
class RolloutShapes:
    """One rollout batch as `grpo-run --plan` gives it to a backend: abstract, no data.

    policy:            a `Policy` whose weights are jax.ShapeDtypeStructs with NamedShardings.
    prompts:           prompts per rollout (rows = prompts * sampling.n).
    max_prompt_length: the longest prompt, in tokens.
    sampling:          as the run samples (stop token ids may be empty: they change no buffer).
    batch_sharding:    NamedSharding of the [prompts * n, ...] batch.
    key:               an abstract PRNG key, replicated on the mesh.
    pad_token_id:      the padding id (the plan, without a tokenizer, pads with 0).
    kept_prefix:       partial rollouts on a kept KV cache: the longest prefix a slot carries
                       (prompt plus tokens so far); each of the `prompts` rows is a slot, the
                       sampling's max_new_tokens a round's budget. 0: no kept cache.
    prompt_table:      (G, n) where those rounds keep each group's prompt once, in a table of G
                       group slots with n rows per group; (): one cache row per slot.
    """

    policy: Policy
    prompts: int
    max_prompt_length: int
    sampling: SamplingParams
    batch_sharding: NamedSharding
    key: Any
    pad_token_id: int = 0
    kept_prefix: int = 0
    prompt_table: tuple = ()


@dataclass(frozen=True)
class RolloutWidths:
    """Widest token columns of a planned rollout: the prompt batch it samples from, and the
    (prompt, completion) columns of the training batch its `trim` returns."""

    prompt: int
    train_prompt: int
    train_completion: int


class PhaseCompiler(Protocol):
    """What `grpo-run --plan` lends a backend to compile its phases with."""

    def compile(self, name: str, build: Callable[[], Any], arguments: Any, *, record: bool = True,
                note: str | Callable[[Any], str] = "") -> Any:
        """`build()` (e.g. `jitted.lower(*abstract_args).compile()`) with the abstract
        `arguments` it takes; recorded as phase `name` of the plan (with `note`, or
        `note(compiled)`) unless `record` is False; recording a name again replaces that phase (its
        note kept when none is given). None when the compiler refused it for memory (a recorded
        refusal shows what it asked for)."""

    def spare_bytes(self, compiled: Any) -> int | None:
        """What a call of `compiled` may take beyond its arguments on a planned device, with
        the state held beside the rollout resident and `grpo_rollout.gather`'s headroom kept
        free; None when the capacity is unknown."""

    def decode_seconds(self, compiled: Any, steps: int) -> float | None:
        """Projected seconds of `steps` tokens of a compiled decode loop (plus what runs once
        around it) on the planned chip; None when the plan has no chip to project for."""


@runtime_checkable
class KeptCacheRollout(Protocol):
    """Optional member of a rollout backend: partial-rollout rounds whose slots keep their KV cache
    between rounds (rollout.partial.kv_cache within_step / across_steps); a backend without it
    can only re-prefill, and a run asking for more says so."""

    def generate_round(self, prefixes: Sequence[Sequence[int]], cached: Sequence[bool], key: jax.Array, sampling: SamplingParams,
                       *, pad_token_id: int = 0, batch_sharding: Any = None, kept_tokens: Sequence[int] | None = None,
                       live: Sequence[bool] | None = None, groups: Any = None) -> RolloutResult:
        """At most sampling.max_new_tokens tokens per slot: slot i continues on its kept cache (holding kept_tokens[i]
        of its prefix, default all but the last) when cached[i], else is admitted; live[i] False: it samples nothing.
        groups: the slots' groups (grpo_rollout.kept_shared.SlotGroups), or None."""

    def release_kept_cache(self) -> None:
        """Frees the kept cache; the next round admits every slot."""

    def kept_cache(self, shapes: RolloutShapes) -> Any:
        """For `grpo-run --plan`: the abstract cache (sharded ShapeDtypeStructs) kept at its widest
        for the partial-rollout rounds `shapes` describes (shapes.kept_prefix > 0)."""


@runtime_checkable
class PlannableRollout(Protocol):
    """Optional member of a rollout backend: `grpo-run --plan` compiles its phases for the
    configured shapes (a backend without it cannot be planned, and says so)."""

    def widths(self, max_prompt_length: int, max_new_tokens: int) -> RolloutWidths:
        """The widest batches of a rollout of prompts up to `max_prompt_length` tokens."""

    def compile_phases(self, shapes: RolloutShapes, compiler: PhaseCompiler) -> None:
        """Compiles every device program one rollout runs, in order, through `compiler`;
        stops after a phase it refuses (the next one's inputs are that one's outputs)."""


@runtime_checkable
class MemoryCheckedRollout(Protocol):
    """Optional member of a rollout backend: the run sets `memory_check(phase name, compiled)`,
    which the backend calls before a program first runs (it refuses one that would not fit)."""
    memory_check: Callable[[str, Any], None] | None


@runtime_checkable
class ProjectingRollout(Protocol):
    """Optional member of a rollout backend that picks its decode layout by projected time on a
    known chip: `projector(compiled decode, steps) -> seconds`."""
    def project_decodes_with(self, projector: Callable[[Any, int], float]) -> None: ...
