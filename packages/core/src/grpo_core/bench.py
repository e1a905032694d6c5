"""`grpo-bench <name> ...`: runs a benchmark registered in entry-point group `grpo_bench`.

Each benchmark prints one JSON line. Packages add theirs with
`[project.entry-points.grpo_bench] <name> = "module:main"` where main(argv) parses its flags.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def available() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group="grpo_bench")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    benches = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: grpo-bench {{{','.join(sorted(benches))}}} [flags]  (grpo-bench NAME --help for flags)")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in benches:
        print(f"grpo-bench: unknown benchmark {name!r}; available: {', '.join(sorted(benches))}", file=sys.stderr)
        return 2
    return benches[name].load()(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
