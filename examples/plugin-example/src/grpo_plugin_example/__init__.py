"""A minimal grpo-jax plugin package."""
