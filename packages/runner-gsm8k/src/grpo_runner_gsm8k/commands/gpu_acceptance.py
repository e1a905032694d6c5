"""`grpo-bench gpu`: the GPU acceptance run; prints ONE JSON line.

    grpo-bench gpu                  # full shapes on a GPU; elsewhere shrunken shapes, GPU-only parts skipped
    grpo-bench gpu --size small     # the shrunken (CI) shapes on any backend

With random weights (nothing is downloaded), five parts, each reported as status ok, skipped (and
why) or error (and the message), so one failing part does not hide the others:
- train: 3 steps of the 0.5B one-GPU preset (configs/gsm8k_qwen25_0p5b_1gpu.yaml: 8 prompts x 8
  samples, up to 384 prompt and 512 new tokens, 16 rows per micro-batch, fused loss, auto attention)
  on a random Qwen2.5-0.5B with the character tokenizer and the arithmetic task: seconds per phase
  per step (step 1 includes compilation) and peak device memory;
- decode: the jax rollout backend's tokens/s at 64 rows (grpo-bench rollout's measurement);
- quantize: the same on int8 and fp8 weights and KV caches beside full precision, with each side's
  decode speedup (fp8 skipped, in one line, on a GPU of compute capability below 8.9);
- loss: the jax, fused and pallas implementations at B1 T4096 V151643 (grpo-bench loss): forward +
  backward ms and the largest difference to jax;
- attention: cuDNN flash attention against the chunked XLA path: ms and the largest difference.
On a backend other than a GPU the shapes shrink (the whole run takes seconds) and pallas and cuDNN
are reported as skipped. Install on a GPU machine over its CUDA JAX: docs/projection.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from grpo_runner_gsm8k.commands.gpu_parts import attention_part, decode_part, loss_part, quantize_part


@dataclass(frozen=True)
class Shapes:
    name: str
    architecture: dict  # HF config.json fields of the random policy
    prompts: int
    n: int
    prompt_tokens: int
    new_tokens: int
    micro_batch: int
    decode_new_tokens: int
    loss: tuple[int, int, int, int]  # batch, time, vocab, hidden
    attention: tuple[int, int, int, int, int]  # batch, time, heads, kv heads, head dim


QWEN25_0P5B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
               "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
               "max_position_embeddings": 1024, "tie_word_embeddings": True}
TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 64,
        "tie_word_embeddings": True}
SHAPES = {
    # configs/gsm8k_qwen25_0p5b_1gpu.yaml's rollout and train shapes (a test keeps them equal)
    "full": Shapes("full", QWEN25_0P5B, 8, 8, 384, 512, 16, 512, (1, 4096, 151643, 896), (1, 4096, 14, 2, 64)),
    # 8 rows: one per device of the test suite's 8 CPU devices
    "small": Shapes("small", TINY, 2, 4, 16, 8, 1, 8, (1, 256, 4096, 64), (1, 256, 4, 2, 16)),
}
GPU_ONLY = ("pallas", "cudnn")  # Triton and cuDNN kernels: skipped on other backends
PARTS = ("train", "decode", "quantize", "loss", "attention")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grpo-bench gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                        help="auto: full on a GPU, small elsewhere")
    parser.add_argument("--steps", type=int, default=3, help="training steps of the preset")
    parser.add_argument("--skip", nargs="*", default=[], choices=PARTS,
                        help="parts not to run")
    return parser.parse_args(argv)


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def guarded(part: Callable[[], dict]) -> dict:
    """A part's record with status ok, or status error and the message (the other parts still run)."""
    start = time.perf_counter()
    try:
        record = {"status": "ok", **part()}
    except Exception as exc:  # reported, not raised: the acceptance line names every failure
        print(traceback.format_exc(), file=sys.stderr)
        record = {"status": "error", "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def train_overrides(shapes: Shapes, steps: int, run_dir: str) -> list[str]:
    return [f"model.architecture={json.dumps(shapes.architecture)}", "model.tokenizer=char", "model.dtype=bfloat16",
            "model.param_dtype=float32", "model.attention=auto", "task.name=arithmetic",
            "task.rewards={correctness: 1.0}", f"rollout.prompts_per_step={shapes.prompts}", f"rollout.n={shapes.n}",
            f"rollout.max_prompt_length={shapes.prompt_tokens}", f"rollout.max_new_tokens={shapes.new_tokens}",
            f"train.steps={steps}", f"train.micro_batch_size_per_device={shapes.micro_batch}", "train.lr=2.0e-6",
            "loss.impl=fused", "eval.every_steps=0", f"logging.dir={run_dir}", "logging.wandb=disabled"]


PHASES = ("rollout_s", "reward_s", "update_s", "step_s")


def train_part(shapes: Shapes, steps: int) -> dict:
    """`steps` steps of the preset, run by the trainer itself (no checkpoint is written)."""
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry
    from grpo_runner_gsm8k.loop import Trainer, build_run

    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(sys.stderr):
        registry = default_registry()
        cfg = load_config(None, train_overrides(shapes, steps, run_dir), registry=registry)
        trainer = Trainer(build_run(cfg, registry))
        try:
            metrics = [trainer.step() for _ in range(steps)]
        finally:
            trainer.ops.logger.close()
            trainer.checkpoints.close()
            trainer.ops.lock.release()
    peak = max((m.get("memory/train/peak_bytes_in_use_max_gib", 0.0) for m in metrics), default=0.0)
    return {"preset": "configs/gsm8k_qwen25_0p5b_1gpu.yaml shapes, random weights" if shapes.name == "full"
            else "shrunken", "rows": shapes.prompts * shapes.n, "max_new_tokens": shapes.new_tokens,
            "steps": [{phase: round(m[f"time/train/{phase}"], 3) for phase in PHASES} for m in metrics],
            "peak_memory_gib": round(peak, 3) if peak else None,
            "prompt_tokens_max": [m["train-seq_len/prompt/max"] for m in metrics],
            "completion_tokens_mean": [round(m["train-seq_len/completion/mean"], 1) for m in metrics]}


def run(args: argparse.Namespace) -> dict:
    gpu = on_gpu()
    shapes = SHAPES[args.size if args.size != "auto" else ("full" if gpu else "small")]
    skipped = {"status": "skipped", "reason": "not run (--skip)"}
    parts: dict[str, Callable[[], dict]] = {
        "train": lambda: train_part(shapes, args.steps), "decode": lambda: decode_part(shapes),
        "quantize": lambda: quantize_part(shapes, gpu), "loss": lambda: loss_part(shapes, gpu),
        "attention": lambda: attention_part(shapes, gpu)}
    record: dict[str, Any] = {"bench": "gpu", "backend": jax.default_backend(),
                              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "shapes": shapes.name}
    if not gpu:
        record["note"] = (f"not a GPU: figures computed by XLA:{jax.default_backend().upper()}; "
                          f"{', '.join(GPU_ONLY)} skipped")
    start = time.perf_counter()
    for name, part in parts.items():
        record[name] = skipped if name in args.skip else guarded(part)
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    record = run(parse_args(argv))
    print(json.dumps(record), flush=True)
    return 0 if all(record[p]["status"] != "error" for p in PARTS) else 1


if __name__ == "__main__":
    sys.exit(main())
