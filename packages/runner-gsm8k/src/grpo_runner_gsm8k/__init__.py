"""grpo_runner_gsm8k."""
