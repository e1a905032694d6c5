"""Registers a toy reward (`brevity`) and a mesh alias (`everything_fsdp` -> `auto`)."""

from dataclasses import dataclass

from grpo_core import MeshSpec, NoOptions, RewardSpec, hookimpl


@dataclass(frozen=True)
class BrevityOptions:
    max_chars: int = 200  # completions up to this length get the full reward


def build_brevity(options: BrevityOptions):
    def brevity(completions: list[str], answers: list[str]) -> list[float]:
        return [max(0.0, 1.0 - len(text) / options.max_chars) for text in completions]

    return brevity


def build_everything_fsdp(options: NoOptions):
    # Resolved lazily so this package needs only grpo-core at import time.
    from grpo_core.registry import default_registry

    auto = default_registry().mesh("auto")
    return auto.factory(auto.options())


@hookimpl
def grpo_rewards():
    return [RewardSpec("brevity", build_brevity, BrevityOptions, "Shorter completions score higher (example)")]


@hookimpl
def grpo_meshes():
    return [MeshSpec("everything_fsdp", build_everything_fsdp, NoOptions, "Alias of `auto` (example)")]
