"""Reading config YAML: a strict SafeLoader, and a bound on what aliases may expand to.

YAML aliases repeat a node by reference, so a few hundred bytes of aliases of aliases (a
"billion laughs" file) describe billions of values; every consumer that copies the config
(validation, `--print-config`, the saved config.yaml) would then expand them. The composed
node graph is measured before anything is constructed, and such a file is refused.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Any, Iterator

import yaml

from grpo_core.errors import ConfigError

# A run config is a few hundred nodes, its free-form mappings (model.architecture, options)
# a few hundred more; 100,000 leaves room for any real one and refuses a bomb in milliseconds.
MAX_EXPANDED_NODES = 100_000
# Real configs nest about five levels; PyYAML's recursive composer gives out near 300.
MAX_NESTING = 100


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` as a float (YAML 1.1 insists on `1.0e-6`), takes only
    true/false as booleans (YAML 1.1 also reads on/off/yes/no, so `distributed: on` became True),
    and refuses documents whose aliases expand past MAX_EXPANDED_NODES."""

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        # PyYAML's scanner revisits every open bracket per token: deep `[[[...` is quadratic.
        if self.flow_level >= MAX_NESTING:
            raise _nesting_error()
        super().fetch_flow_collection_start(token_class)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        check_expansion(node)
        return self.construct_document(node)


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?(?:\d[\d_]*)?\.\d+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def _mapping_without_duplicates(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """YAML silently keeps the last of two equal keys (or sections); here that is an error. Merge
    keys (`<<: *base`) are YAML's: the mapping's own keys win over merged ones."""
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, typing.Hashable):
            raise ConfigError(f"config key at line {key_node.start_mark.line + 1} is a {type(key).__name__}; "
                              "keys are names such as rollout or n")
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} at lines {seen[key]} and {key_node.start_mark.line + 1} "
                              "of the config; keep one of them (merge duplicated sections into one)")
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _children(node: yaml.Node) -> Iterator[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        yield from node.value
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key
            yield value


def check_expansion(root: yaml.Node) -> None:
    """Counts the nodes of the fully expanded document without expanding it: each distinct node
    once, its size the sum of its children's (an iterative post-order walk, so depth costs no
    Python stack). Refuses an alias of itself, nesting past MAX_NESTING and expansion past
    MAX_EXPANDED_NODES."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # the nodes on the current path: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[id(node)] > MAX_EXPANDED_NODES:
                raise _expansion_error(node)
        elif id(node) not in sizes:
            if id(node) in open_nodes:
                raise ConfigError(f"the YAML alias at line {node.start_mark.line + 1} of the config refers to a "
                                  "node that contains it, an endless value; write the value out instead")
            if len(open_nodes) >= MAX_NESTING:
                raise _nesting_error()
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))


def _expansion_error(node: yaml.Node) -> ConfigError:
    return ConfigError(f"the config's YAML aliases expand to more than {MAX_EXPANDED_NODES:,} values "
                       f"(grpo_core.config_yaml.MAX_EXPANDED_NODES; the value at line {node.start_mark.line + 1} "
                       "alone exceeds it, a real config has a few hundred): aliases of aliases multiply; write "
                       "the repeated values out or alias them without nesting")


def _nesting_error() -> ConfigError:
    return ConfigError(f"the config nests values more than {MAX_NESTING} levels deep "
                       "(grpo_core.config_yaml.MAX_NESTING; a real config has about five); flatten it")


def parse_yaml(text: str) -> Any:
    """The value of one YAML document, read by the config loader's rules."""
    try:
        return yaml.load(text, Loader=_Loader)
    except RecursionError:  # PyYAML composes recursively: nesting beyond the stack fails before our walk
        raise _nesting_error() from None


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file (`~` expanded); a missing file or a non-mapping is a ConfigError."""
    path = Path(os.path.expanduser(path))
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing YAML file to --config")
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{line}: "
                          f"{getattr(exc, 'problem', exc)}; fix the syntax") from None
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; write at least one section, or leave out --config "
                          "to run the embedded defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}; "
                          "write the sections (model:, task:, rollout:, train:, ...) as top-level keys")
    return data
