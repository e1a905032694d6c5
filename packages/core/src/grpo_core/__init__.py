"""grpo_core."""
