"""The `grpo-run` and `grpo-bench` subcommands: each reads its arguments and calls into the packages below."""
