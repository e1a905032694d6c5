"""What a phase costs: analytic FLOPs, the roofline seconds of a compiled program, the
device memory it is checked against and the message when it does not fit.

A leaf below both the training loop (memory check, decode-layout choice) and the offline
planner (`grpo-run --plan`, `grpo-bench flops`): it imports neither."""
