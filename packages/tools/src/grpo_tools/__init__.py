"""Tools a policy may call during a multi-turn rollout."""
