"""Building a run from its config: the pieces, their checks, the policy model (full or LoRA), the teacher."""
