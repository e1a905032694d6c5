"""The built-in step samplers (`grpo_core.step_samplers.StepSampler`), one per way a step's
groups are sampled, and `factory.step_sampler`, which picks the run's by its config:

  multi-turn  rollout.multi_turn.enabled      tool-using rows (grpo_runner_gsm8k.samplers.multi_turn_step)
  partial     rollout.partial.enabled         a pool of decode slots, rows carried across steps
  refill      loss.dynamic_sampling_mode=refill  extra rollouts until enough groups are informative
  plain       otherwise                       one rollout, every row to its end

The config allows at most one of the first three (checked when it loads).
"""
