"""The configuration reference (Markdown) generated from the config dataclasses themselves.

Each field's type comes from its annotation, its default and range from `setting`, its
description from the field's `doc` metadata, and its "why" from the `#` comment written
above the field in the source: the manual's reference page is this text, rebuilt on every
docs build, so it cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from typing import Any, Literal, Union

import yaml

from grpo_core.config import RunConfig

_RANGE_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_TYPE_WORDS = {type(None): "null", int: "integer", float: "number", str: "string", bool: "true/false",
               dict: "mapping", list: "list", Any: "any"}


@dataclasses.dataclass(frozen=True)
class ReferenceRow:
    """One config key as the reference shows it."""

    key: str  # dotted, e.g. rollout.partial.kv_cache
    type: str
    default: str
    range: str
    doc: str
    why: str  # the comment above the field in the source, "" when there is none


def describe_type(annotation: Any) -> str:
    """`one of 'a', 'b'`, `integer or null`, ...: the annotation in the words the loader checks."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(describe_type(arg) for arg in typing.get_args(annotation))
    if dataclasses.is_dataclass(annotation):
        return "section"
    return _TYPE_WORDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def describe_default(field: dataclasses.Field) -> str:
    """The default as YAML would write it (`null`, `true`, `{}`, `0.001`)."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(its own table)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def describe_range(metadata: typing.Mapping) -> str:
    return " and ".join(f"{symbol} {metadata[name]}" for name, symbol in _RANGE_BOUNDS
                        if metadata.get(name) is not None)


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `#` comment lines right above its definition in the class source, and
    the comment after it on its own line (`name: int = 4  # why`)."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        trailing = stripped.partition("  # ")[2].strip() if match else ""
        if match and (pending or trailing):
            comments[match.group(1)] = " ".join([*pending, trailing]).strip()
        pending = []
    return comments


def section_rows(cls: type, prefix: str) -> list[ReferenceRow]:
    """One row per field of dataclass `cls`, keys under `prefix` (e.g. "rollout.")."""
    hints, why = typing.get_type_hints(cls), field_comments(cls)
    return [ReferenceRow(prefix + field.name, describe_type(hints[field.name]), describe_default(field),
                         describe_range(field.metadata), field.metadata.get("doc", ""), why.get(field.name, ""))
            for field in dataclasses.fields(cls)]


def sections(root: type = RunConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted name, dataclass) of every section below `root`, depth first, in field order."""
    found: list[tuple[str, type]] = []
    hints = typing.get_type_hints(root)
    for field in dataclasses.fields(root):
        if dataclasses.is_dataclass(hints[field.name]):
            name = prefix + field.name
            found.append((name, hints[field.name]))
            found += sections(hints[field.name], name + ".")
    return found


def reference_rows(root: type = RunConfig) -> list[ReferenceRow]:
    """Every key of every section, in the order the reference lists them."""
    return [row for name, cls in sections(root) for row in section_rows(cls, name + ".")]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row_markdown(row: ReferenceRow) -> str:
    name = row.key.rsplit(".", 1)[-1]
    key = f'<a id="{row.key}"></a>`{name}`'
    if row.type == "section":
        key = f"[`{name}`](#{row.key})"
    why = f" *Why:* {row.why}" if row.why else ""
    range_ = f"`{row.range}`" if row.range else ""
    default = row.default if row.type == "section" else f"`{row.default}`"
    return "| " + " | ".join(_cell(text) for text in (key, row.type, default, range_, row.doc + why)) + " |"


TABLE_HEAD = ["| key | type | default | range | what, and why |", "| --- | --- | --- | --- | --- |"]


def class_doc(cls: type) -> str:
    """The class docstring as written (a dataclass without one gets a generated signature: none)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def section_markdown(name: str, cls: type) -> list[str]:
    return [f"## `{name}` {{#{name}}}", "", class_doc(cls), "", *TABLE_HEAD,
            *(_row_markdown(row) for row in section_rows(cls, name + ".")), ""]


def reference_markdown(root: type = RunConfig) -> str:
    """The whole reference page."""
    lines = ["# Configuration reference", "",
             "Generated from `grpo_core.config` when the manual is built: every section and key, its type, "
             "default and allowed range as `grpo-run` checks them when the config loads, and what it is for. "
             "Dotted keys are what overrides take (`grpo-run --config X train.lr=1e-6`); how loading treats "
             "overrides, merge keys, `~` and numbers is in [Configuration](configuration.md).", ""]
    for name, cls in sections(root):
        lines += section_markdown(name, cls)
    return "\n".join(lines)
