"""`grpo-run export --run-dir R --out D [--step N]`: the policy of a run as a Hugging Face
directory (config.json, safetensors, tokenizer) that `transformers` loads.

The model is rebuilt from the checkpoint alone (its resolved config and the model's HF
config are saved with it), abstractly, and filled with the checkpoint's params on one
host device; nothing is compiled and no mesh is needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from grpo_core.errors import UserError
from grpo_core.models import QwenConfig, QwenModel, export_pretrained, init_from_config

from grpo_runner_gsm8k.build import build_tokenizer
from grpo_runner_gsm8k.checkpoint import (checkpoint_dir, complete_steps, saved_meta, saved_params,
                                          saved_run_config)
from grpo_runner_gsm8k.cli import ArgumentParser


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="grpo-run export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="the run's logging.dir (holds checkpoints/)")
    parser.add_argument("--out", required=True, help="directory to write the HF model to")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the newest)")
    return parser


def pick_step(run_dir: Path, step: Optional[int] = None) -> int:
    """The newest complete checkpoint of `run_dir`, or `step` when it is one of them."""
    if not run_dir.is_dir():
        raise UserError(f"--run-dir {str(run_dir)!r} is not a directory; pass the logging.dir of a run")
    steps = complete_steps(run_dir)
    if not steps:
        raise UserError(f"--run-dir {str(run_dir)!r} holds no complete checkpoint in {checkpoint_dir(run_dir)}; "
                        "export a run that saved one (every run saves its last step)")
    if step is not None and step not in steps:
        raise UserError(f"--step {step}: {checkpoint_dir(run_dir)} has no complete checkpoint of that step; "
                        f"available: {', '.join(map(str, steps))}")
    return steps[-1] if step is None else step


def _host_device() -> jax.Device:
    """Where exported params are gathered: host memory when the CPU backend is up."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names accelerators only
        return jax.local_devices()[0]


def load_policy(run_dir: Path, step: int) -> tuple[QwenModel, Any]:
    """The policy model of checkpoint `step` (params on one device) and the run's tokenizer."""
    cfg = saved_run_config(run_dir, step)
    qcfg = QwenConfig.from_hf_dict(saved_meta(run_dir, step)["model_config"])
    abstract = nnx.eval_shape(lambda: init_from_config(qcfg, dtype=cfg.model.dtype))
    graphdef, shapes = nnx.split(abstract)
    on_host = SingleDeviceSharding(_host_device())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_host), shapes)
    return nnx.merge(graphdef, saved_params(run_dir, step, target)), build_tokenizer(cfg)


def export_run(run_dir: str | Path, out_dir: str | Path, step: Optional[int] = None) -> int:
    """Writes checkpoint `step` (default: the newest) of `run_dir` to `out_dir`; returns the step."""
    run_dir = Path(run_dir)
    step = pick_step(run_dir, step)
    model, tokenizer = load_policy(run_dir, step)
    try:
        export_pretrained(model, out_dir, tokenizer)
    except OSError as exc:
        raise UserError(f"--out {str(out_dir)!r}: cannot write the model ({exc.strerror}); "
                        "choose a writable directory") from None
    return step


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    step = export_run(args.run_dir, args.out, args.step)
    print(f"exported step {step} of {args.run_dir} to {args.out}")
    return 0
