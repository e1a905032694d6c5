"""`grpo-run export --run-dir R --out D [--step N]`: the policy of a run as a Hugging Face
directory (config.json, safetensors, tokenizer) that `transformers` loads.

The model is rebuilt from the checkpoint alone (its resolved config and the model's HF
config are saved with it): the run's abstract twin (plan.abstract.abstract_run) on one
host device, filled with the checkpoint's params; nothing is compiled.

`--out` must be new or empty; `--force` writes into a non-empty directory, replacing files
of the same name, but never deletes or shadows weights it did not write: the files an
export writes are listed in `<out>/.grpo-export.json`, and weight files not listed there
make even `--force` stop (a base model's directory is never overwritten by mistake).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import jax
from flax import nnx

from grpo_core.config import MeshConfig
from grpo_core.errors import UserError
from grpo_core.models import QwenModel, export_pretrained
from grpo_core.models.hf_io import INDEX_FILE
from grpo_core.models.config import SUPPORTED_DTYPES
from grpo_core.models.peft_io import save_peft
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.assembly.adapters import SavedAdapters, saved_base
from grpo_runner_gsm8k.assembly.build import build_tokenizer
from grpo_runner_gsm8k.operations.checkpoint import Resume, checkpoint_dir, complete_steps
from grpo_runner_gsm8k.cli import ArgumentParser
from grpo_runner_gsm8k.plan.abstract import abstract_run
from grpo_runner_gsm8k.assembly.run import BuiltRun


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="grpo-run export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="the run's logging.dir (holds checkpoints/)")
    parser.add_argument("--out", required=True, help="directory to write the HF model to")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the newest)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty --out (same-named files are replaced)")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES,
                        help="dtype of the written weights (default: the model's torch_dtype)")
    parser.add_argument("--peft", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT adapter directory instead of merged weights")
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


def saved_run(run_dir: Path, step: int) -> tuple[Resume, BuiltRun]:
    """Checkpoint `step` as read, and the abstract twin of its run on one host device, for the
    model config saved with it (one device, whatever mesh it trained on: export compiles nothing)."""
    saved = Resume.read(run_dir, [step])
    cfg = dataclasses.replace(saved.run_config, mesh=MeshConfig())
    return saved, abstract_run(cfg, default_registry(), [_host_device()], saved.model_config)


def load_policy(run_dir: Path, step: int) -> tuple[QwenModel, Any]:
    """The policy model of checkpoint `step` (params on one device; a LoRA run's adapters
    merged into its base) and the run's tokenizer."""
    saved, run = saved_run(run_dir, step)
    if run.policy.adapter_spec is not None:
        return saved_adapters(saved, run).merged_model(), build_tokenizer(run.cfg.model)
    return nnx.merge(run.policy.train_graphdef, saved.params(run.state.params)), build_tokenizer(run.cfg.model)


def saved_adapters(saved: Resume, run: BuiltRun) -> SavedAdapters:
    """A LoRA checkpoint's adapters and base (refused when the base is not the one they were trained on)."""
    with jax.default_device(_host_device()):
        base_graphdef, base = saved_base(run.cfg.model, run.qcfg, saved.meta.get("lora_base"), saved.where)
    return SavedAdapters(run.policy.adapter_spec, base_graphdef, base, saved.params(run.state.params))


def saved_lora(run_dir: Path, step: int) -> SavedAdapters:
    return saved_adapters(*saved_run(run_dir, step))


def export_peft(run_dir: Path, step: int, out_dir: Path) -> None:
    saved, run = saved_run(run_dir, step)
    if run.policy.adapter_spec is None:
        raise UserError(f"--peft: the run in {str(run_dir)!r} trained every parameter (model.lora.rank is null), "
                        "so it has no adapters; export it without --peft")
    save_peft(out_dir, saved_adapters(saved, run).arrays(), run.policy.adapter_spec, run.cfg.model.path)


MANIFEST = ".grpo-export.json"


def _is_weight_file(name: str) -> bool:
    """What the HF exporter replaces or removes in its output directory."""
    return name == INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors"))


def _previous_export(out: Path) -> set[str]:
    try:
        return set(json.loads((out / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _stats(out: Path) -> dict[str, tuple[int, int]]:
    """name -> (mtime, size) of the files in `out`: what an export changed is what it wrote."""
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir()} if out.is_dir() else {}


def check_out_dir(out: Path, force: bool) -> None:
    """--out is new or empty; with --force it may hold files, but no weights of another origin."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; give a directory")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not force:
        raise UserError(f"--out {str(out)!r} is not empty (holds {', '.join(present[:3])}"
                        f"{', ...' if len(present) > 3 else ''}); choose a new or empty directory, or pass --force "
                        "to write into it")
    foreign = [name for name in present if _is_weight_file(name) and name not in _previous_export(out)]
    if foreign:
        raise UserError(f"--out {str(out)!r} holds weights this export did not write ({', '.join(foreign[:3])}), "
                        "which exporting there would replace; choose another --out or move those files away")


def export_run(run_dir: str | Path, out_dir: str | Path, step: Optional[int] = None, force: bool = False,
               dtype: Optional[str] = None, peft: bool = False) -> int:
    """Writes checkpoint `step` (default: the newest) of `run_dir` to `out_dir` in `dtype`
    (default: the model's torch_dtype; the stored float32 masters are rounded to it), or with
    `peft` a LoRA run's adapters as a PEFT directory; returns the step."""
    run_dir, out_dir = Path(run_dir).expanduser(), Path(out_dir).expanduser()
    step = pick_step(run_dir, step)
    check_out_dir(out_dir, force)
    before = _stats(out_dir)
    try:
        if peft:
            export_peft(run_dir, step, out_dir)
        else:
            model, tokenizer = load_policy(run_dir, step)
            export_pretrained(model, out_dir, tokenizer, dtype=dtype or model.config.torch_dtype)
        written = sorted(name for name, stat in _stats(out_dir).items() if before.get(name) != stat)
        (out_dir / MANIFEST).write_text(json.dumps({"files": [n for n in written if n != MANIFEST]}, indent=1))
    except OSError as exc:
        raise UserError(f"--out {str(out_dir)!r}: cannot write the model ({exc.strerror}); "
                        "choose a writable directory") from None
    return step


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    step = export_run(args.run_dir, args.out, args.step, force=args.force, dtype=args.dtype, peft=args.peft)
    print(f"exported step {step} of {args.run_dir} to {args.out}")
    return 0
