"""Every distribution the product imports is declared in pyproject.toml (a dependency or an extra's): an import of
an undeclared one works only where something else happened to install it. Builds nothing: it reads the sources."""

import ast
import importlib.metadata
import re
import sys
import tomllib

from .conftest import ROOT

PRODUCT = ("distillspec", "actors", "cluster", "jobs", "benchmarks")


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def _imported() -> dict[str, str]:
    """Top-level modules the product imports (outside the standard library and itself) -> a file importing each."""
    found = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PRODUCT:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_distribution_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {
        module: where
        for module, where in _imported().items()
        if not any(_name(d) in declared for d in distributions.get(module, [module]))
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
