"""The built-in `grpo-run` subcommands, registered through the `grpo_commands` hook like a
plugin's. Each module is imported only when its command runs, so `grpo-run plugins` stays fast."""

from __future__ import annotations

import importlib
from typing import Callable

from grpo_core import CommandSpec


def plugins_main(argv: list[str]) -> int:
    """`grpo-run plugins`: every registered plugin by kind, with the distribution providing it."""
    from grpo_core.errors import UserError
    from grpo_core.registry import HOOK_BY_KIND, default_registry

    if argv:
        raise UserError(f"grpo-run plugins takes no arguments, got {' '.join(argv)!r}")
    registry = default_registry()
    width = max([14, *(len(name) for kind in HOOK_BY_KIND for name in registry.names(kind))])
    for kind in HOOK_BY_KIND:
        print(f"{kind}:")
        for item in registry.entries(kind):
            print(f"  {item.spec.name:<{width}} {item.distribution:<20} {item.spec.description}")
    return 0


def lazy_main(module: str) -> Callable[[list[str]], int]:
    """`module.main(argv)`, imported when called."""
    def main(argv: list[str]) -> int:
        return importlib.import_module(module).main(argv)

    main.__name__ = f"{module}.main"
    return main


COMMAND_SPECS = (
    CommandSpec("plugins", plugins_main, description="list every registered plugin and its distribution"),
    CommandSpec("export", lazy_main("grpo_runner_gsm8k.commands.export"), description="a run's checkpoint -> HF directory"),
    CommandSpec("report", lazy_main("grpo_runner_gsm8k.commands.report"), description="metrics.jsonl -> PNG plots"),
    CommandSpec("launch", lazy_main("grpo_runner_gsm8k.commands.launch"),
                description="start or print the per-host commands of a multi-host run"),
    CommandSpec("eval", lazy_main("grpo_runner_gsm8k.commands.evaluate"),
                description="mean@n, pass@k, maj@k of a model, export or checkpoint on tasks' test sets"),
)
