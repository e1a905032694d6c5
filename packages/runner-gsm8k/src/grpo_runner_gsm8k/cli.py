"""`grpo-run`: the command line of grpo-jax.

    grpo-run [--config X.yaml] [section.key=value ...]   train (defaults: the tiny CPU run)
    grpo-run --config X.yaml --print-config              print the resolved config
    grpo-run plugins                                     list every registered plugin
    grpo-run eval [--run-dir R] [--tasks a,b] [overrides]  evaluate a model (see eval_command)
    grpo-run <command> ...                               a subcommand (export, report, launch, a plugin's)

Every failure prints one line to stderr: `grpo-run: error: ...`. Exit codes: 2 bad input,
3 the run does not fit in memory, 1 anything else (its traceback, config and versions go to
`<run dir>/crash-<time>.log`, named in the line); `--debug` also prints the traceback.
SIGTERM or SIGINT during training finishes the step in progress, saves a checkpoint, prints
one line and exits 128 + the signal number (143, 130); the same command continues the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from grpo_core.errors import RunFault, UserError
from grpo_runner_gsm8k.operations import orbax_noise
from grpo_runner_gsm8k.environ import environment, unset
from grpo_runner_gsm8k.operations.crash import CONTEXT, begin, report_crash
from grpo_runner_gsm8k.operations.preemption import Stopped

EXIT_SIGINT = 128 + 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors, so they print as one line like every other bad input."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")


def train_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="grpo-run", description="GRPO post-training of LLMs in JAX.")
    parser.add_argument("--config", help="YAML run config (default: the embedded tiny CPU config)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--debug", action="store_true", help="also print the traceback of an error")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in logging.dir (an error if there is none)")
    parser.add_argument("--plan", action="store_true",
                        help="AOT-compile rollout and train step with abstract inputs and print per-device memory")
    parser.add_argument("--sweep", metavar="FIELD",
                        help="with --plan: find the largest micro_batch_size_per_device that fits, or (with --target) "
                             "the model.remat policy with the fastest projected update that fits")
    parser.add_argument("--target", metavar="SLICE",
                        help="with --plan: compile for this TPU slice (v6e-8, v4-16, v5e-4, or v6e:4x4), or N "
                             "slices over the DCN (2xv6e-8, v5p-128x2; with mesh.slices=N), with the TPU compiler, "
                             "on any host (needs the tpu extra)")
    parser.add_argument("--capacity-gib", type=float, metavar="GIB",
                        help="with --plan: device memory budget to plan against (default: what the device reports)")
    parser.add_argument("--chip", metavar="NAME=VALUE,...",
                        help="with --target: replace the chip's figures (peak_tflops, hbm_gbps, ici_gbps, "
                             "usable_hbm_gib, collective_latency_us, dcn_host_gbps, dcn_latency_us) the projection "
                             "and the verdict use")
    parser.add_argument("--expect-completion-tokens", type=int, metavar="N",
                        help="with --target: also project a step whose rows sample N tokens (default: only the max)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, values parsed as YAML scalars (train.lr=1e-6)")
    return parser


def _load(args: argparse.Namespace):
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry

    return load_config(args.config, args.overrides, registry=default_registry())


def _train(cfg, args: argparse.Namespace) -> int:
    from grpo_core.registry import default_registry

    if not args.plan and (args.target or args.sweep):
        raise UserError(f"{'--target' if args.target else '--sweep'} only applies to --plan; add --plan")
    if not args.target and (args.chip or args.expect_completion_tokens is not None):
        flag = "--chip" if args.chip else "--expect-completion-tokens"
        raise UserError(f"{flag} only applies to --plan --target SLICE; add --target (e.g. v6e-8)")
    if args.plan:
        from grpo_runner_gsm8k.plan import plan_command

        return plan_command(cfg, default_registry(), sweep=args.sweep, capacity_gib=args.capacity_gib,
                            target=args.target, chip=args.chip, expect_tokens=args.expect_completion_tokens)
    from grpo_runner_gsm8k.loop import train
    from grpo_runner_gsm8k.plan.slots import decided_slots

    registry = default_registry()
    train(decided_slots(cfg, registry), registry, resume=args.resume)
    return 0


def _train_command(argv: list[str]) -> int:
    args = train_parser().parse_intermixed_args(argv)
    cfg = _load(args)
    _remember_run(cfg)
    if args.print_config:
        from grpo_core.config_io import config_to_yaml
        from grpo_core.registry import default_registry
        from grpo_runner_gsm8k.assembly.build import check_inputs
        from grpo_runner_gsm8k.samplers.multi_turn_step import check_tool_prompts

        registry = default_registry()
        _, inputs = check_inputs(cfg, registry)  # every check a run makes before device work
        check_tool_prompts(cfg.rollout, cfg.eval, cfg.task, inputs, registry)  # and the multi-turn sampler's, made when it is built

        print(config_to_yaml(cfg), end="")
        return 0
    return _train(cfg, args)


def _remember_run(cfg) -> None:
    """The crash log's place and contents, once the config is known."""
    from pathlib import Path

    from grpo_core.config_io import config_to_yaml

    CONTEXT.run_dir, CONTEXT.config_yaml = Path(cfg.logging.dir), config_to_yaml(cfg)


def run(argv: list[str]) -> int:
    """A subcommand (`grpo-run <name> ...`, any plugin's `grpo_commands`), or training."""
    if argv and is_command_word(argv[0]):
        from grpo_core.registry import default_registry

        registry = default_registry()
        if argv[0] not in registry.names("command"):
            raise UserError(unknown_command(argv[0], registry.names("command")))
        return registry.command(argv[0]).factory(argv[1:])
    return _train_command(argv)


def is_command_word(word: str) -> bool:
    """A bare word: not a flag, an override (`section.key=value`) or a path."""
    return not word.startswith("-") and not any(c in word for c in "=./~")


def unknown_command(word: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown command {word!r}{hint}; commands: {', '.join(names)}; to train, give --config X.yaml "
            "and overrides as section.key=value")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"grpo-run: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # transformers serves tokenizers and configs only; its notice that torch is absent is noise here.
    with environment(**unset(TRANSFORMERS_NO_ADVISORY_WARNINGS="1", TRANSFORMERS_VERBOSITY="error")):
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    warnings.showwarning = _show_warning
    orbax_noise.install()
    begin(argv)
    try:
        return run(argv)
    except Stopped as exc:
        print(f"grpo-run: {exc}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        if "--debug" in argv:
            traceback.print_exc()
        one_line = " ".join(str(exc).split())
        print(f"grpo-run: error: {one_line}", file=sys.stderr)
        return leave_peers(exc.exit_code, at_once=isinstance(exc, RunFault))
    except KeyboardInterrupt:  # outside training (which turns SIGINT into a saved stop): nothing to save
        print("grpo-run: interrupted (SIGINT) outside a training step; the last checkpoint is as it was",
              file=sys.stderr)
        return leave_peers(EXIT_SIGINT)
    except Exception as exc:  # noqa: BLE001 - the error boundary: no traceback reaches the user
        code = report_crash(exc, debug="--debug" in argv)
        if has_peers():
            jax = sys.modules["jax"]
            print(f"grpo-run: process {jax.process_index()} of {jax.process_count()} failed; when another "
                  "process failed first, its log has the cause", file=sys.stderr)
        return leave_peers(code)


def has_peers() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def leave_peers(code: int, at_once: bool = False) -> int:
    """A process of a multi-process run that fails on its own exits at once: at JAX's shutdown
    barrier it would wait for peers still running (5 minutes, then a crash dump). Its
    peers are stopped by JAX's coordination service when its heartbeat stops. A failed save
    (`at_once`) exits at once too: orbax's threads of that save wait minutes at interpreter
    shutdown for signals the failed save never sends."""
    if not (at_once or has_peers()):
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
