"""Evaluation shared by training (`eval.every_steps`) and `grpo-run eval`: sampling, metrics, store, stream."""
