"""The pieces of a run and their checks against the config: plugins, tokenizer, model config and
model, samplings, prompts, batch arithmetic (rows, micro-batches) and the run directory."""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax
from jax.sharding import Mesh

from grpo_core.advantage_records import AdvantageSetup
from grpo_core.config import EvalConfig, LoggingConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig
from grpo_core.contracts import RolloutBackend, SamplingParams, Task
from grpo_core.config_io import plugin_options
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig, init_from_config, load_pretrained
from grpo_core.models.attention_impls import resolve_attention
from grpo_core.models.config import architecture_keys
from grpo_core.models.hf_io import resolve_model_dir
from grpo_core.registry import Registry
from grpo_core.sharding import shard_model
from grpo_core.tokenizer import CALCULATOR_CALL_TOKENS, TOOL_CALL_TOKENS, build_char_tokenizer, load_tokenizer
from grpo_meshes import TRAIN_BATCH_AXES, ModelDims, batch_shard_count, validate_plan

from grpo_runner_gsm8k.assembly.adapters import check_lora_fits
from grpo_runner_gsm8k.assembly.decode_layouts import check_decode_layouts
from grpo_runner_gsm8k.multihost import local_prompt_count
from grpo_runner_gsm8k.samplers.multi_turn_inputs import check_multi_turn_inputs
from grpo_runner_gsm8k.assembly.teacher import check_teacher_positions, check_teacher_tokenizer
from grpo_runner_gsm8k.tasks.base import prompts_to_check
from grpo_runner_gsm8k.tasks.graders import use_graders_of
from grpo_runner_gsm8k.tokens import prompt_token_ids
from grpo_runner_gsm8k.training.router_term import router_coef, routing_replay


def _input_error(key: str, exc: Exception, fix: str) -> UserError:
    """A UserError for a bad value of `key`, keeping the cause's message."""
    return UserError(f"{key}: {str(exc).rstrip('.')}; {fix}")


def from_plugin(registry: Registry, kind: str, name: str, options: dict, where: str, **kwargs) -> Any:
    spec = registry.get(kind, name)
    checked = plugin_options(spec.options, options, where)
    try:
        built = spec.factory(checked, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's factory (third-party code) failing on its input
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"{where} of {kind} {name!r}: {detail}; fix the options or the plugin's inputs") from None
    check_contract(kind, name, built)
    return built


CONTRACTS = {"rollout": RolloutBackend, "task": Task}


def check_contract(kind: str, name: str, built: Any) -> None:
    """A plugin object missing a method of its protocol fails here, not mid-run."""
    protocol = CONTRACTS.get(kind)
    if protocol is None or isinstance(built, protocol):
        return
    members = {*vars(protocol), *getattr(protocol, "__annotations__", {})}
    missing = [m for m in members if not m.startswith("_") and not hasattr(built, m)]
    raise UserError(f"{kind} {name!r} built a {type(built).__name__} without {', '.join(sorted(missing))}, "
                    f"which grpo_core.contracts.{protocol.__name__} requires; implement them in the plugin")


# model.tokenizer names of the in-process character tokenizers and their extra special tokens.
CHAR_TOKENIZERS = {"char": (), "char-tools": TOOL_CALL_TOKENS,
                   "char-calculator": (*TOOL_CALL_TOKENS, *CALCULATOR_CALL_TOKENS)}


def build_tokenizer(model_cfg: ModelConfig) -> Any:
    source = model_cfg.tokenizer  # model.path when null in the file (filled in at load)
    if source in CHAR_TOKENIZERS:
        return build_char_tokenizer(extra_special_tokens=CHAR_TOKENIZERS[source])
    if source is None:
        raise UserError("model.tokenizer and model.path are both null: set model.tokenizer to 'char' "
                        "or to a tokenizer directory / Hub id")
    key = "model.path" if source == model_cfg.path else "model.tokenizer"
    if _looks_like_path(source) and not os.path.isdir(source):
        raise UserError(f"{key} {source!r} is not a directory; point {key} at a directory holding tokenizer "
                        "files, a Hub id 'org/name', or set model.tokenizer=char")
    try:
        return load_tokenizer(source)
    except FileNotFoundError as exc:
        raise _input_error(key, exc, f"point {key} at a directory holding tokenizer files") from None


def _looks_like_path(source: str) -> bool:
    """Absolute, relative or existing paths; anything else may be a Hub id."""
    return os.path.isabs(source) or source.startswith(("./", "../", "~")) or os.path.exists(source)


def model_config(model_cfg: ModelConfig, tokenizer: Any) -> QwenConfig:
    """The architecture of the run's model, read before any weights are loaded."""
    if model_cfg.path:
        try:
            return QwenConfig.from_pretrained_dir(resolve_model_dir(model_cfg.path))
        except (OSError, ValueError) as exc:
            raise _input_error("model.path", exc, "point model.path at an HF model directory "
                               "(config.json + *.safetensors) or a Hub id") from None
    # A random-init model's own dtype is its compute dtype (what export writes by default).
    check_architecture_keys(model_cfg.architecture)
    arch = {"vocab_size": len(tokenizer), "torch_dtype": model_cfg.dtype, **model_cfg.architecture}
    try:
        return QwenConfig.from_hf_dict(arch)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"model.architecture: {exc}") from None


def check_architecture_keys(architecture: dict) -> None:
    """model.architecture is strict like every other section: a typo is an error, not a default."""
    valid = architecture_keys()
    for key in architecture:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.6)
            hint = f"did you mean model.architecture.{close[0]}?" if close else "see the fields of QwenConfig"
            raise UserError(f"unknown config key model.architecture.{key}; {hint}")


def check_tokenizer_fits(qcfg: QwenConfig, tokenizer: Any) -> None:
    try:
        qcfg.check_tokenizer_fits(len(tokenizer), "use a matching tokenizer or raise model.architecture.vocab_size")
    except ValueError as exc:
        raise UserError(str(exc)) from None


def build_model(model_cfg: ModelConfig, qcfg: QwenConfig, mesh: Mesh, strategy: Any, dtype: str) -> Any:
    """The policy, its weights stored in `dtype` (adapters.storage_dtype), with params sharded by
    the strategy's param rules and its residual stream by the activation rules (batch over the data axes)."""
    model = load_or_init_model(model_cfg, qcfg, mesh, strategy.param_rules, dtype)
    model.set_activation_sharding(mesh, strategy.activation_rules)
    attention = attention_impl(model_cfg, mesh)
    model.set_attention(attention)
    print(f"attention: {attention} (model.attention={model_cfg.attention})")
    return model


def attention_impl(model_cfg: ModelConfig, mesh: Mesh) -> str:
    """model.attention resolved for the mesh's platform; cudnn in float32 is a user error."""
    try:
        return resolve_attention(model_cfg.attention, model_cfg.dtype, mesh.devices.flat[0].platform)
    except ValueError as exc:
        raise _input_error("model.attention", exc, "or set model.dtype=bfloat16") from None


def load_or_init_model(model_cfg: ModelConfig, qcfg: QwenConfig, mesh: Mesh, rules: Any, dtype: str) -> Any:
    if model_cfg.path:
        try:
            return load_pretrained(model_cfg.path, dtype=dtype, mesh=mesh, rules=rules,
                                   remat=model_cfg.remat, scan_layers=model_cfg.scan_layers)
        except (OSError, ValueError) as exc:  # missing, corrupt or mismatched safetensors
            raise _input_error("model.path", exc, "re-download or re-export the checkpoint") from None
    model = init_from_config(qcfg, seed=model_cfg.seed, dtype=dtype, remat=model_cfg.remat,
                             scan_layers=model_cfg.scan_layers)
    return shard_model(model, mesh, rules)


def stop_token_ids(rollout: RolloutConfig, tokenizer: Any) -> tuple[int, ...]:
    return () if rollout.ignore_eos else tuple(sorted({tokenizer.eos_token_id} - {None}))


def sampling_params(rollout: RolloutConfig, stop: tuple[int, ...], eval_cfg: Optional[EvalConfig] = None,
                    record_routing: bool = False) -> SamplingParams:
    """How the run samples for training (or, given `eval_cfg`, for eval), stopping at the `stop` token ids;
    `record_routing`: training rollouts record a mixture-of-experts model's routing (loss.routing_replay)."""
    if eval_cfg is not None:
        return SamplingParams.from_config(rollout, stop, max_new_tokens=eval_cfg.max_new_tokens,
                                          n=eval_cfg.n, greedy=eval_cfg.greedy)
    return SamplingParams.from_config(rollout, stop, record_routing=record_routing)


def check_lengths(rollout: RolloutConfig, eval_cfg: EvalConfig, qcfg: QwenConfig) -> None:
    new_tokens_key = "rollout.max_new_tokens"
    if eval_cfg.max_new_tokens > rollout.max_new_tokens:
        new_tokens_key = "eval.max_new_tokens"
    new_tokens = max(rollout.max_new_tokens, eval_cfg.max_new_tokens)
    longest = rollout.max_prompt_length + new_tokens
    if longest > qcfg.max_position_embeddings:
        raise UserError(f"rollout.max_prompt_length + {new_tokens_key} = {rollout.max_prompt_length} + "
                        f"{new_tokens} = {longest} exceeds the model's max_position_embeddings "
                        f"{qcfg.max_position_embeddings}; lower {new_tokens_key} or rollout.max_prompt_length")


def check_prompts(tokenizer: Any, task: Any, examples: list, *, system_prompt: Optional[str],
                  max_length: int) -> dict[str, list[int]]:
    """Renders and tokenizes every prompt the run can see (`prompts_to_check`), so a prompt format
    or length that cannot work fails before the run starts, not mid-run; returns the token ids by
    example id (the run reuses them instead of tokenizing again)."""
    ids = prompt_token_ids(tokenizer, examples, use_chat_template=task.use_chat_template, system_prompt=system_prompt,
                           max_prompt_length=max_length)
    return {ex.id: row for ex, row in zip(examples, ids) if ex.id}


def rows_per_step(rollout: RolloutConfig) -> int:
    return rollout.prompts_per_step * rollout.n


def with_micro_batch_size(cfg: RunConfig, size: int) -> RunConfig:
    """`cfg` with `train.micro_batch_size_per_device = size` (the plan's sweep)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size_per_device=size))


def micro_batches(rollout: RolloutConfig, train: TrainConfig, mesh: Mesh) -> int:
    """Gradient-accumulation steps: rows / (micro_batch_size_per_device * data-parallel devices)."""
    rows = rows_per_step(rollout)
    per_device = train.micro_batch_size_per_device
    if per_device == 0:
        return 1
    global_micro = per_device * batch_shard_count(mesh, TRAIN_BATCH_AXES)
    if rows % global_micro:
        raise UserError(f"train.micro_batch_size_per_device={per_device} gives micro-batches of {global_micro} "
                        f"rows, which do not divide the {rows} rows of a step (rollout.prompts_per_step * "
                        "rollout.n); pick a per-device size that divides it")
    return rows // global_micro


def preflight(rollout: RolloutConfig, train: TrainConfig, mesh: Mesh, qcfg: QwenConfig,
              devices: Optional[list] = None) -> None:
    """Checks before any compile; `devices` (default: this run's) are those the mesh must cover."""
    devices = jax.devices() if devices is None else devices
    rows = rows_per_step(rollout)
    validate_plan(mesh, ModelDims.from_config(qcfg), rollout_batch=rows,
                  train_micro_batch=rows // micro_batches(rollout, train, mesh), rollout_style=rollout.sharding,
                  device_count=len(devices))


@dataclass
class Inputs:
    """What a run reads before any device work: every check of the config against them is done."""

    tokenizer: Any
    task: Any
    rewards: dict[str, tuple[Any, float]]
    prompt_ids: dict[str, list[int]]
    prompts_per_process: int  # prompts each process takes per step
    estimator: Any = None  # the advantage estimator (grpo_core.contracts.AdvantageEstimator)


def check_inputs(cfg: RunConfig, registry: Registry, process_index: int = 0,
                 process_count: int = 1) -> tuple[QwenConfig, Inputs]:
    """(model config, inputs): tokenizer, model config, task data, reward functions and every
    prompt, checked against the config (no device is touched: `--print-config` runs this too)."""
    prompts_per_process = local_prompt_count(cfg.rollout.prompts_per_step, process_count)
    tokenizer = build_tokenizer(cfg.model)
    qcfg = model_config(cfg.model, tokenizer)
    check_tokenizer_fits(qcfg, tokenizer)
    check_lora_fits(cfg.model.lora, qcfg)
    check_lengths(cfg.rollout, cfg.eval, qcfg)
    check_decode_layouts(cfg.rollout, qcfg)
    router_coef(cfg.loss, qcfg)  # refuses a balance coefficient for a dense model before any load
    routing_replay(cfg.loss, cfg.rollout, qcfg)  # and routing replay where nothing is recorded
    if cfg.teacher.path:
        check_teacher_tokenizer(cfg.teacher, tokenizer)
        check_teacher_positions(cfg.teacher, cfg.rollout)
    use_graders_of(registry)  # a task that grades by name (dataset) finds the run's graders
    task = from_plugin(registry, "task", cfg.task.name, cfg.task.options, "task.options", seed=cfg.task.seed,
                       process_index=process_index, process_count=process_count)
    check_multi_turn_inputs(cfg, tokenizer, task, qcfg.max_position_embeddings)
    rewards = {name: (from_plugin(registry, "reward", name, cfg.task.reward_options.get(name, {}),
                                  f"task.reward_options.{name}"), float(weight))
               for name, weight in cfg.task.rewards.items()}
    estimator = from_plugin(registry, "advantage", cfg.loss.advantage_estimator, cfg.loss.advantage_options,
                            "loss.advantage_options", setup=AdvantageSetup.from_config(cfg))
    prompt_ids = check_prompts(tokenizer, task, first_examples(cfg.eval, cfg.task.name, task, prompts_per_process),
                               system_prompt=cfg.task.system_prompt, max_length=cfg.rollout.max_prompt_length)
    return qcfg, Inputs(tokenizer, task, rewards, prompt_ids, prompts_per_process, estimator)


def first_examples(eval_cfg: EvalConfig, task_name: str, task: Any, prompts_per_process: int) -> list:
    """prompts_to_check, with a task plugin that fails on its options (a ValueError, a template's
    KeyError or IndexError) reported as bad task options, not as a crash."""
    try:
        return prompts_to_check(eval_cfg, task, prompts_per_process)
    except (ValueError, KeyError, IndexError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"task.options of task {task_name!r}: {type(exc).__name__}: {detail} while making its "
                        "first examples; fix the options or the plugin's inputs") from None


def check_run_dir(logging: LoggingConfig) -> None:
    """Fails when logging.dir cannot be created and written, without creating anything."""
    run_dir = Path(logging.dir).absolute()
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not existing.is_dir():
        where = "it" if existing == run_dir else repr(str(existing))
        raise UserError(f"logging.dir {str(run_dir)!r} cannot be used as a directory: {where} is a file; "
                        "choose another logging.dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"logging.dir {str(run_dir)!r} is not writable (no write permission on "
                        f"{str(existing)!r}); choose a writable logging.dir")


def prepare_run_dir(logging: LoggingConfig) -> Path:
    run_dir = Path(logging.dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A name of its own: every process of a multi-host run probes the same (shared) directory.
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"logging.dir {str(run_dir)!r} is not writable ({exc.strerror}); "
                        "choose a writable directory") from None
    return run_dir

