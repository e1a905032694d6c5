"""What keeps a run alive and observable: checkpoints, lock, preemption, crash log, metric sinks, memory checks."""
