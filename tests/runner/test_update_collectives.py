"""The fused loss on a multi-device mesh runs per device (shard_map over the run's mesh): the
update moves the LM head's weight and gradient, never logits. Left to the partitioner, the
blockwise loop over batch-sharded hidden states and an FSDP-sharded head contracts the sharded
hidden dim and all-reduces float32 [tokens, vocab] logits blocks (80 GB per update on the 3B
v6e-8 preset)."""

from __future__ import annotations

import pytest
from grpo_core.hlo import HloModule, array_dims, COLLECTIVES
from grpo_core.registry import default_registry
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.plan.abstract import abstract_run

# A vocab no other dim of the tiny model equals, so a collective's vocab-sized dim is the LM head's.
SHAPE = ["model.tokenizer=char", "model.architecture.vocab_size=384", "model.architecture.hidden_size=64",
         "rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=8", "mesh.strategy=full_fsdp"]


def vocab_collectives(cfg, vocab: int) -> list[str]:
    """Shapes of the compiled update's collectives that carry a vocab-sized dim."""
    inputs = plan.PlanInputs(abstract_run(cfg, default_registry()))
    lower, args = plan.update_lowering(inputs, cfg.train.micro_batch_size_per_device)
    module = HloModule(lower(*args).compile().as_text())
    return [inst.shape for comp in module.computations.values() for inst in comp.instructions
            if inst.op.removesuffix("-done").removesuffix("-start") in COLLECTIVES
            and any(vocab in dims for dims in array_dims(inst.shape))]


@pytest.mark.parametrize("impl", ["fused", "pallas"])
def test_the_blockwise_losses_move_the_head_never_logits(tiny_config, impl):
    cfg = tiny_config(*SHAPE, f"loss.impl={impl}")
    shapes = vocab_collectives(cfg, 384)
    assert shapes  # the head itself is gathered and its gradient reduced
    for shape in shapes:
        assert all(sorted(dims) == [64, 384] for dims in array_dims(shape) if 384 in dims), shape
