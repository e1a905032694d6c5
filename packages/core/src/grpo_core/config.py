"""Run configuration: frozen dataclasses loaded strictly from YAML.

Every field carries its documentation and its allowed values in the field's metadata (see
`setting`), so validation, error messages and `--print-config` all read from one place. Plugin
options (`<section>.options`) are validated by the selected plugin's own options dataclass
(`grpo_core.validate`). The field helper `setting` lives in `config_fields`, the rollout's own
sub-sections in `config_rollout` (both re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from grpo_core.config_fields import JAX_SEED_MAX, LORA_TARGETS, NUMPY_SEED_MAX, Number, setting  # noqa: F401
from grpo_core.config_rollout import MultiTurnConfig, PartialConfig


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA: train low-rank adapters on a frozen base (rank null = full-parameter training)."""

    rank: Optional[int] = setting(
        None, "Adapter rank r; null trains every parameter. The base stays frozen in model.dtype (no float32 "
        "master, no optimizer state); adapters A [in, r], B [r, out] train in float32.", ge=1)
    # 16: PEFT's common r=8..16 setting scaled so alpha / r = 1 at r = 16.
    alpha: float = setting(16.0, "Adapter scale numerator: scale = alpha / rank (alpha / sqrt(rank) with rslora).",
                           gt=0.0)
    dropout: float = setting(0.0, "Dropout on the adapters' input during training (only 0 is supported).",
                             ge=0.0, lt=1.0)
    target_modules: list = setting(
        ["all-linear"], "Projections that get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj, or all-linear (all seven).")
    rslora: bool = setting(False, "rsLoRA scaling alpha / sqrt(rank) instead of alpha / rank.")
    init_from: Optional[str] = setting(
        None, "A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; "
        "null starts at B = 0 (step 0 is the base model).")


@dataclass(frozen=True)
class ModelConfig:
    """The policy model and its tokenizer."""

    path: Optional[str] = setting(
        None, "HF model directory or Hub id; null builds a random-init model from `architecture`.")
    architecture: dict = setting({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 192,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "max_position_embeddings": 256, "tie_word_embeddings": True},
        "HF config.json fields of the random-init model, used only when `path` is null "
        "(vocab_size defaults to the tokenizer's size).")
    tokenizer: Optional[str] = setting(
        None, "Tokenizer directory or Hub id; null = `path` (filled in at load); 'char' builds the character "
        "tokenizer; 'char-tools' the same with Qwen's tool tokens (<tool_call>, </tool_call>) added; "
        "'char-calculator' also with a calculator call's fixed text as two tokens (configs/tiny_tools.yaml).")
    dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "Compute dtype of every forward and backward pass (norms and softmax always run in float32).")
    # float32 masters keep updates of lr ~1e-6 that a bfloat16 weight rounds away.
    param_dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "Storage dtype of the trainable params (master weights); bfloat16 loses updates below "
        "its resolution (0.2-0.4% of a weight).")
    remat: Literal["none", "dots", "full"] = setting(
        "none", "Activation rematerialisation per decoder layer during training.")
    attention: Literal["auto", "xla", "chunked", "splash", "cudnn"] = setting(
        "auto", "Multi-token attention (training and the prompt pass): xla holds [B, heads, T, T] "
        "scores; chunked (any backend), splash (TPU Pallas kernel) and cudnn (GPU, 16-bit dtypes) "
        "never do; auto = splash on TPU, cudnn on GPU in bfloat16, chunked otherwise.")
    scan_layers: bool = setting(True, "Run the decoder layers as one scan (compile time independent of depth); "
                                "false loops over them in Python, for debugging.")
    seed: int = setting(0, "Seed of the random initialisation and of the LoRA adapters' A (a JAX key: "
                        "fits 32 bits).", ge=0, le=JAX_SEED_MAX)
    lora: LoRAConfig = field(default_factory=LoRAConfig, metadata={"doc": "LoRA adapters (see LoRAConfig)."})


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts and reference answers come from, and how completions are scored."""

    name: str = setting("arithmetic", "Task plugin name (see `grpo-run plugins`).")
    options: dict = setting({}, "Options of the task plugin, validated by its options dataclass.")
    system_prompt: Optional[str] = setting(None, "System message of the chat template; null for none.")
    rewards: dict = setting(
        {"correctness": 1.0}, "Reward function name -> weight; the total reward is the weighted sum.")
    reward_options: dict = setting(
        {}, "Reward function name -> options mapping, validated by that reward's options dataclass.")
    seed: int = setting(0, "Seed of the data order (shuffled per epoch; a numpy seed: fits 64 bits).", ge=0,
                        le=NUMPY_SEED_MAX)


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of completions."""

    backend: str = setting("jax", "Rollout backend plugin name.")
    options: dict = setting({}, "Options of the rollout backend.")
    prompts_per_step: int = setting(8, "Prompts P per training step (global, all hosts).", ge=1)
    n: int = setting(8, "Samples K per prompt (the GRPO group size).", ge=1)
    max_prompt_length: int = setting(64, "Prompts longer than this many tokens are rejected.", ge=1)
    max_new_tokens: int = setting(16, "Maximum sampled tokens per completion.", ge=1)
    # Bounded: logits / temperature must stay a meaningful float32 (1e39 overflows to inf).
    temperature: float = setting(1.0, "Sampling temperature; the loss uses the same value.", gt=0.0, le=100.0)
    top_p: float = setting(1.0, "Nucleus sampling mass (1.0 disables).", gt=0.0, le=1.0)
    top_k: int = setting(0, "Keep only the k most likely tokens (0 disables).", ge=0)
    greedy: bool = setting(False, "Take the argmax instead of sampling.")
    ignore_eos: bool = setting(
        False, "Never stop at EOS: every row samples max_new_tokens (benchmarks with comparable token counts).")
    sharding: Literal["legacy", "maxtext"] = setting(
        "legacy", "Rollout batch sharding: legacy = over dp*fsdp*tp, maxtext = over dp only.")
    use_sampler_logps: bool = setting(
        False, "Use the sampler's log-probs as old log-probs instead of one extra forward pass.")
    quantize: Literal["none", "int8", "fp8", "fp8_block"] = setting(
        "none", "Sample from int8 or fp8 (e4m3) per-channel projection weights, or fp8 with a scale per 128 x 128 "
        "block (fp8_block); the trainer stays in full precision.")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = setting("auto", "Rollout KV cache: auto = options.cache_dtype or "
        "model.dtype; int8 or fp8 (e4m3), a float32 scale per token and KV head, read in model.dtype (not the trainer).")
    partial: PartialConfig = field(default_factory=PartialConfig,
                                   metadata={"doc": "Partial rollouts carried across steps (see PartialConfig)."})
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig,
                                        metadata={"doc": "Multi-turn, tool-using rollouts (see MultiTurnConfig)."})


@dataclass(frozen=True)
class TrainConfig:
    """The policy update."""

    steps: int = setting(60, "Training steps (one rollout batch each).", ge=1)
    optimizer: Literal["adamw", "lion", "sgd"] = setting("adamw", "Optimizer.")
    lr: float = setting(1e-3, "Peak learning rate.", gt=0.0)
    weight_decay: float = setting(0.0, "Decoupled weight decay (adamw, lion).", ge=0.0)
    b1: float = setting(0.9, "First-moment decay (adamw, lion).", ge=0.0, lt=1.0)
    b2: float = setting(0.99, "Second-moment decay (adamw, lion).", ge=0.0, lt=1.0)
    schedule: Literal["constant", "cosine", "linear"] = setting(
        "constant", "Decay after warmup, down to lr * min_lr_ratio at the last step.")
    warmup_steps: int = setting(0, "Linear warmup steps from 0 to lr.", ge=0)
    min_lr_ratio: float = setting(0.1, "Final lr as a fraction of lr (cosine, linear).", ge=0.0, le=1.0)
    max_grad_norm: Optional[float] = setting(1.0, "Clip by global norm; null disables.", gt=0.0)
    ppo_epochs: int = setting(1, "Passes over each rollout batch (the clipped ratio matters when > 1).", ge=1)
    micro_batch_size_per_device: int = setting(
        0, "Sequences per device per micro-batch; 0 means the whole batch in one micro-batch.", ge=0)
    seed: int = setting(0, "Seed of sampling and dropout-free training randomness (a JAX key: fits 32 bits).",
                        ge=0, le=JAX_SEED_MAX)
    moment_dtype: Optional[Literal["float32", "bfloat16"]] = setting(
        None, "Dtype of the optimizer moments; null = the trained params' storage dtype: model.param_dtype, "
        "or float32 with LoRA (the adapters' dtype) (filled in at load).")


@dataclass(frozen=True)
class LossConfig:
    """The GRPO objective (one math; `impl` picks the implementation)."""

    impl: str = setting("fused", "Loss implementation plugin: jax (reference), fused, pallas.")
    options: dict = setting({}, "Options of the loss implementation (block sizes, ...).")
    epsilon_low: float = setting(0.2, "Lower clip: ratio >= 1 - epsilon_low.", ge=0.0, lt=1.0)
    epsilon_high: float = setting(0.2, "Upper clip: ratio <= 1 + epsilon_high (DAPO uses 0.28).", ge=0.0)
    epsilon_c: Optional[float] = setting(
        None, "Dual clip for negative advantages: loss capped at epsilon_c * |A|; null disables.", gt=1.0)
    logratio_clamp: Optional[float] = setting(
        None, "Clamp log(ratio) to [-c, c] before exp, against overflow; null disables.", gt=0.0)
    importance_sampling_level: Literal["token", "sequence"] = setting(
        "token", "token = per-token ratios (GRPO); sequence = GSPO sequence-mean log-ratio.")
    policy_loss: Literal["clip", "cispo", "sapo"] = setting(
        "clip", "Policy-gradient term: clip = PPO clipped surrogate; cispo = capped, stop-gradient importance "
        "weight on every token's log-prob (MiniMax-M1); sapo = sigmoid soft gate on the ratio (Qwen SAPO).")
    # 5.0: ScaleRL's eps_max, TRL's recommendation. TRL passes it as epsilon_high with loss_type="cispo";
    # here epsilon_high stays the clip's 1 + eps, so the cap has its own name.
    cispo_epsilon_max: float = setting(
        5.0, "cispo: upper bound of the importance weight, min(ratio, cispo_epsilon_max).", ge=1.0)
    # 1.0 / 1.05: the SAPO paper's and TRL's defaults (a faster decay for negative advantages).
    sapo_temperature_pos: float = setting(1.0, "sapo: gate temperature of tokens with advantage > 0.", gt=0.0)
    sapo_temperature_neg: float = setting(1.05, "sapo: gate temperature of tokens with advantage <= 0.", gt=0.0)
    beta: float = setting(0.0, "KL coefficient; > 0 loads a frozen reference model.", ge=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = setting("k3", "Estimator of KL(policy || reference).")
    # Off by default: the plain k3 term is the GRPO paper's; on matches TRL's use_bias_correction_kl.
    kl_importance_weighted: bool = setting(
        False, "Multiply the per-token KL estimate by the importance ratio (TRL's use_bias_correction_kl).")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_length_norm"] = setting(
        "token_mean", "How per-token losses are reduced (fixed_length_norm = Dr.GRPO).")
    max_completion_length: Optional[int] = setting(
        None, "Normaliser of fixed_length_norm; null = rollout.max_new_tokens (filled in at load).", ge=1)
    entropy_coef: float = setting(
        0.0, "Entropy bonus coefficient (0 = entropy is only a metric); aggregated like the loss.", ge=0.0)
    compute_entropy: bool = setting(True, "Report the policy entropy metric.")
    router_balance_coef: float = setting(
        0.0, "Mixture-of-experts models: coefficient of the Switch load-balancing loss added to the objective "
        "(0 = router/* metrics only; Qwen3-30B-A3B's config.json has 0.001); refused for a dense model.", ge=0.0)
    routing_replay: bool = setting(False, "Mixture-of-experts models: the training forward sends each completion "
                                   "token to the experts the rollout routed it to, gate weights from the current "
                                   "router (rollout routing replay); refused for a dense model.")
    scale_rewards: Literal["group", "batch", "none"] = setting(
        "group", "Advantage = (r - group mean) / std, with std of the group, the batch, or 1.")
    std_ddof: int = setting(1, "Delta degrees of freedom of the advantage std.", ge=0)
    advantage_eps: float = setting(1e-4, "Added to the std to avoid division by zero.", ge=0.0)
    advantage_estimator: str = setting(
        "grpo", "Advantage estimator plugin: grpo (scaled by scale_rewards), rloo (leave-one-out baseline), "
        "reinforce_pp_baseline (group mean, std of the step), gdpo (each reward normalised in its group).")
    advantage_options: dict = setting({}, "Options of the advantage estimator.")
    dynamic_sampling: bool = setting(False, "Mask out groups whose rewards all agree (zero std).")
    dynamic_sampling_mode: Literal["mask", "refill"] = setting(
        "mask", "With dynamic_sampling: mask = train on the informative groups of the one rollout; refill = "
        "roll out fresh prompts until prompts_per_step informative groups (DAPO) or max_extra_rollouts.")
    # 4: DAPO's runs needed ~2-3 generation batches per step once most groups were solved.
    max_extra_rollouts: int = setting(
        4, "Refill: extra rollouts of prompts_per_step prompts per step at most; missing groups stay masked.", ge=1)
    mismatch_correction: Literal["none", "truncate", "mask"] = setting(
        "none", "Rollout/training mismatch correction of the policy-gradient term by rho = pi_train_old / "
        "pi_sampler: truncate = weight clip(rho, c_min, c_max) (TIS); mask = weight rho inside "
        "[c_min, c_max], 0 outside (MIS).")
    mismatch_level: Literal["token", "sequence"] = setting(
        "token", "token = one rho per token; sequence = exp of the summed log-ratio of the sequence, for all its tokens.")
    # 2.0: verl's rollout-correction default threshold.
    mismatch_c_max: float = setting(2.0, "Upper threshold of rho.", gt=0.0)
    mismatch_c_min: Optional[float] = setting(None, "Lower threshold of rho; null = no lower bound.", gt=0.0)
    mask_truncated_completions: bool = setting(
        False, "Leave completions cut at rollout.max_new_tokens without a stop token out of the loss (DAPO).")
    top_entropy_quantile: float = setting(
        1.0, "Train the policy-gradient term only on the top fraction q of each micro-batch's completion "
        "tokens by policy entropy (1.0 = every token).", gt=0.0, le=1.0)


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation: a frozen teacher scores every sampled token (see grpo_runner_gsm8k.assembly.teacher)."""

    path: Optional[str] = setting(
        None, "HF model directory or Hub id of the teacher; null = no teacher. Its tokenizer must be the student's.")
    dtype: Optional[Literal["float32", "bfloat16"]] = setting(
        None, "Dtype the teacher is stored and run in; null = model.dtype (filled in at load when path is set).")
    placement: Literal["sharded", "replicated"] = setting(
        "sharded", "sharded = split over the mesh by the policy's parameter rules, like the reference model; "
        "replicated = a whole copy on every device (no weight gathers while scoring, more memory).")
    coef: float = setting(
        1.0, "Weight c of the per-token advantage -c * (logp_student - logp_teacher), a reverse-KL estimate "
        "(estimator sampled), or of the exact KL term c * KL (estimator full).", gt=0.0)
    use_task_reward: bool = setting(
        False, "false = the distillation term alone; true = added to the task's advantage (sampled) or loss (full).")
    # none: the sources' estimator as is; leave_one_out removes the large common part of d_t (a
    # random-init student starts ~6 nats from its teacher) that only adds variance.
    baseline: Literal["none", "leave_one_out"] = setting(
        "none", "Subtracted from d_t: none, or leave_one_out = the mean d_t over the completion tokens of the other "
        "rows of the prompt's group (unbiased, lower variance; needs rollout.n >= 2).")
    estimator: Literal["sampled", "full"] = setting(
        "sampled", "sampled = the one-token estimate d_t as a token-level advantage; full = coef * the exact reverse "
        "KL(student || teacher) over the whole vocabulary at every completion token, added to the loss "
        "(grpo_losses.full_kl).")
    # the reverse KL is mode-seeking and slow from a near-uniform student; the forward KL is the
    # teacher's cross-entropy on the student's own prefixes (grpo_losses.full_kl)
    divergence: Literal["reverse", "forward"] = setting(
        "reverse", "Direction of the exact KL of estimator full: reverse = KL(student || teacher), forward = "
        "KL(teacher || student); the sampled estimator is always the reverse one.")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh and multi-host set-up."""

    strategy: str = setting(
        "auto", "Mesh strategy plugin (auto, host_local, full_fsdp, fsdp_tp) or an explicit 'dp,fsdp,tp'.")
    options: dict = setting({}, "Options of the mesh strategy.")
    slices: int = setting(
        1, "Slices joined by the data-center network (DCN): the strategy's shape is one slice's, and the "
        "slices multiply mesh.slice_axis (on TPU, JAX's hybrid mesh; elsewhere equal groups of the devices).", ge=1)
    slice_axis: Literal["dp", "fsdp"] = setting(
        "dp", "The axis the slices extend: dp (data parallel across slices: a step's only DCN traffic is the "
        "gradient reduction) or fsdp (parameters and optimizer state sharded across slices too; their gathers "
        "then cross the DCN).")
    expert_parallel: Literal["auto", True, False] = setting(
        "auto", "Mixture-of-experts models: split the experts over the fsdp axis (each device holds E / fsdp whole "
        "experts, gathers its fsdp group's tokens and reduce-scatters their outputs back) instead of all-gathering "
        "every expert's weights per layer; auto = when that moves fewer bytes per layer (printed with both counts); "
        "never for a dense model or when fsdp does not divide the experts.")
    require_process_count: Optional[int] = setting(
        None, "Fail fast unless exactly this many processes joined; null skips the check.", ge=1)
    distributed: Literal["auto", "on", "off"] = setting(
        "auto", "Call jax.distributed.initialize: auto = when the environment or pod asks for it.")
    coordinator_address: Optional[str] = setting(None, "host:port of process 0 (multi-host without auto-detect).")
    num_processes: Optional[int] = setting(None, "Process count (multi-host without auto-detect).", ge=1)
    process_id: Optional[int] = setting(None, "This process's id (multi-host without auto-detect).", ge=0)
    # Pods start their workers within seconds; a worker that never comes is reported after this.
    init_timeout_s: int = setting(
        60, "Seconds jax.distributed waits for every process to join before the run exits with an error.", ge=1)


@dataclass(frozen=True)
class EvalConfig:
    """Periodic evaluation on the task's test split."""

    every_steps: int = setting(0, "Evaluate every N steps (0 disables; also runs after the last step).", ge=0)
    num_questions: int = setting(64, "Test questions per evaluation.", ge=1)
    greedy: bool = setting(True, "Greedy decoding for accuracy.")
    n: int = setting(1, "Samples per question; pass@n is reported when > 1.", ge=1)
    max_new_tokens: Optional[int] = setting(
        None, "Sampled tokens per eval completion; null = rollout.max_new_tokens (filled in at load).", ge=1)
    reward: str = setting("correctness", "The reward of task.rewards that judges an answer.")
    pass_threshold: float = setting(1.0, "An answer is correct when eval.reward gives at least this.")
    tasks: dict = setting(
        {}, "Task name -> options evaluated besides the training task (in training, logged as eval/<task>/...; "
        "`grpo-run eval` runs these, or the training task when empty). Each task grades with its own grader.")
    k: list = setting([], "The k of pass@k and maj@k (each 1..eval.n); empty = 1, 2, 4, ... up to eval.n.")


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics, progress and the run directory."""

    dir: str = setting("runs/tiny", "Run directory: metrics.jsonl, checkpoints, resolved config.")
    wandb: Literal["online", "offline", "disabled"] = setting("disabled", "Weights & Biases mode.")
    project: str = setting("grpo-jax", "W&B project.")
    name: Optional[str] = setting(None, "W&B run name; null lets W&B choose.")
    group: Optional[str] = setting(None, "W&B group.")
    # 25: the 600-step tiny run prints 24 progress lines plus the summary to a log file.
    every_steps: int = setting(25, "Print a progress line every N steps when not on a TTY.", ge=1)


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    # A hard kill loses at most 100 steps; SIGTERM/SIGINT (spot VM preemption) save the step in progress.
    every_steps: int = setting(
        100, "Save every N steps; the last step and a step stopped by SIGTERM/SIGINT are always saved "
        "(0 = only those).", ge=0)
    keep: int = setting(2, "Most recent checkpoints kept.", ge=1)
    resume: Literal["auto", "never"] = setting(
        "auto", "auto = continue from the newest checkpoint in logging.dir when there is one; "
        "never = refuse a logging.dir that holds checkpoints (--resume still continues).")


@dataclass(frozen=True)
class RunConfig:
    """A whole run. Load with `grpo_core.config_io.load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
