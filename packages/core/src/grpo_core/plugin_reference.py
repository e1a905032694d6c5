"""The plugin options reference (Markdown), generated from the registered plugins' options dataclasses.

Each plugin's `options:` mapping is checked against its own frozen dataclass; this page lists,
for every installed loss, mesh, rollout backend, task and reward, that dataclass's keys with the
type, default and comment the code gives them (see `grpo_core.config_reference`).
"""

from __future__ import annotations

import re
from typing import Any

from grpo_core.config_reference import TABLE_HEAD, class_doc, section_rows
from grpo_core.specs import SPEC_TYPES

# Where each kind's options sit in a run config, and the key that selects the plugin.
OPTIONS_KEY = {"loss": "loss.options", "rollout": "rollout.options", "mesh": "mesh.options",
               "task": "task.options", "reward": "task.reward_options.{name}"}
SELECTED_BY = {"loss": "loss.impl", "rollout": "rollout.backend", "mesh": "mesh.strategy",
               "task": "task.name", "reward": "task.rewards"}


def _plain_row(row: Any) -> str:
    """A row without the per-key anchor: two plugins may share a key name."""
    why = f" *Why:* {row.why}" if row.why else ""
    cells = (f"`{row.key.rsplit('.', 1)[-1]}`", row.type, f"`{row.default}`", row.range and f"`{row.range}`",
             row.doc + why)
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def plugin_markdown(kind: str, provided: Any) -> list[str]:
    """One plugin: what it is, who provides it, and its options table."""
    spec = provided.spec
    key = OPTIONS_KEY.get(kind, f"{kind}.options").format(name=spec.name)
    anchor = re.sub(r"[^\w-]", "-", f"{kind}-{spec.name}")
    lines = [f"### `{spec.name}` {{#{anchor}}}", "",
             f"{spec.description.rstrip('.')}. Provided by `{provided.distribution}`; options under `{key}`.", ""]
    rows = section_rows(spec.options, key + ".")
    if not rows:
        return lines + ["No options.", ""]
    return lines + _doc_markdown(class_doc(spec.options)) + [*TABLE_HEAD, *(_plain_row(row) for row in rows), ""]


def _doc_markdown(doc: str) -> list[str]:
    """The docstring's first paragraph as text; the rest (often a per-field list aligned in columns)
    as a text block, which keeps its layout."""
    summary, _, details = doc.partition("\n\n")
    lines = [" ".join(summary.split()), ""] if summary else []
    return lines + (["```text", details.strip(), "```", ""] if details.strip() else [])


def plugin_reference_markdown(registry: Any) -> str:
    """The whole page, for every kind and every plugin `registry` holds."""
    lines = ["# Plugin options reference", "",
             "Generated from the installed plugins when the manual is built (`grpo-run plugins` lists the "
             "same names). A plugin's options are checked against its options dataclass when the config "
             "loads, like the keys of the [configuration reference](configuration-reference.md).", ""]
    for kind in SPEC_TYPES:
        selected_by = SELECTED_BY.get(kind, kind)
        lines += [f"## {kind} plugins {{#{kind}}}", "", f"Selected by `{selected_by}`.", ""]
        for provided in registry.entries(kind):
            lines += plugin_markdown(kind, provided)
    return "\n".join(lines)
