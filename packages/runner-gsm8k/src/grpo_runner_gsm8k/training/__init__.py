"""The loop, the jitted update step, advantages and scoring: what one training step runs."""
