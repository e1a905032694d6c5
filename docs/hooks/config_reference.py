"""mkdocs hook: the configuration and plugin options reference pages, generated on every build from
`grpo_core.config` and from the installed plugins' options dataclasses."""

from mkdocs.structure.files import File, Files

from grpo_core.config_reference import reference_markdown
from grpo_core.plugin_reference import plugin_reference_markdown
from grpo_core.registry import default_registry

CONFIG_PAGE = "configuration-reference.md"
PLUGIN_PAGE = "plugin-options.md"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, CONFIG_PAGE, content=reference_markdown()))
    files.append(File.generated(config, PLUGIN_PAGE, content=plugin_reference_markdown(default_registry())))
    return files
