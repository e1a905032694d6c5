"""mkdocs hook: links from the manual to repository files outside docs/ (package READMEs, source).

Pages write them repository-relative (`../packages/meshes/README.md`), so they work where the
Markdown is read on GitHub. mkdocs only knows docs/ and would report them as missing; this
hook checks instead that each target exists in the repository (a missing one is a warning,
which `--strict` turns into a failure, as for a broken page link) and rewrites it for the
site: to `repo_url` + `/blob/<branch>/<path>` when mkdocs.yml sets `repo_url` (branch:
`extra.repo_branch`, default main), else to the path as code, since the site holds no copy.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>\.\./[^)\s#]*)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^(```.*?^```)", re.S | re.M)


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config.config_file_path).parent
    docs = Path(config.docs_dir).relative_to(root).as_posix()
    page_dir = posixpath.join(docs, posixpath.dirname(page.file.src_uri))
    parts = FENCE.split(markdown)  # odd parts are fenced code: left alone
    for index in range(0, len(parts), 2):
        parts[index] = LINK.sub(lambda link: _rewrite(link, page, page_dir, root, config), parts[index])
    return "".join(parts)


def _rewrite(link: re.Match, page, page_dir: str, root: Path, config) -> str:
    path = posixpath.normpath(posixpath.join(page_dir, link["target"]))
    if path.startswith("../") or not (root / path).exists():
        log.warning(f"Doc file '{page.file.src_uri}' links to '{link['target']}', which is not a file of the "
                    f"repository (resolved: {path})")
        return link[0]
    if config.repo_url:
        branch = config.extra.get("repo_branch", "main")
        return f"[{link['text']}]({config.repo_url.rstrip('/')}/blob/{branch}/{path}{link['anchor'] or ''})"
    shown = f"`{path}`"
    return shown if link["text"].strip("`/") == path.rstrip("/") else f"{link['text']} ({shown})"
