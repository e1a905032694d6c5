"""Imports every module of one package (argv[1]) and prints how many: run in an environment
holding only that workspace member and its declared dependencies, a module importing an
undeclared package fails here. Imports inside functions are checked statically by
tests/e2e/test_declared_imports.py."""

import importlib
import pkgutil
import sys


def main(package_name: str) -> int:
    package = importlib.import_module(package_name)
    names = [package_name] + [m.name for m in pkgutil.walk_packages(package.__path__, package_name + ".")]
    for name in names:
        importlib.import_module(name)
    print(f"{package_name}: {len(names)} modules import")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
