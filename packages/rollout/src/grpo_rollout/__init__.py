"""grpo_rollout."""
