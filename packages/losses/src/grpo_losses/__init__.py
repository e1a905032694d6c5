"""grpo_losses."""
