"""mkdocs hook: the configuration reference page, generated from `grpo_core.config` on every build."""

from mkdocs.structure.files import File, Files

from grpo_core.config_reference import reference_markdown

PAGE = "configuration-reference.md"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, PAGE, content=reference_markdown()))
    return files
