"""The library's layout: every name ``distillspec`` exports resolves, and every module of its sub-packages imports in
a fresh interpreter, in either order (an import cycle fails one of the two)."""

import importlib
import subprocess
import sys

import pytest

import distillspec

from .conftest import ROOT

#: Runs only inside vLLM's worker processes (it patches vLLM's kernels when imported).
INSIDE_VLLM = {"distillspec.serving.vllm_worker"}
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "distillspec").rglob("*.py")
    if "scores" not in p.parts[-3:-1] or p.name == "__init__.py"
)


def test_every_exported_name_resolves():
    missing = [name for name in distillspec.__all__ if getattr(distillspec, name, None) is None]
    assert not missing


@pytest.mark.parametrize("order", ["forward", "backward"])
def test_every_module_imports(order):
    modules = [m for m in MODULES if m not in INSIDE_VLLM]
    modules = modules if order == "forward" else modules[::-1]
    code = f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)"
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_sub_packages_are_the_parts():
    parts = {p.name for p in (ROOT / "distillspec").iterdir() if (p / "__init__.py").exists()}
    assert parts == {"decoding", "training", "models", "serving", "tasks", "evaluation"}
    for part in parts:
        assert importlib.import_module(f"distillspec.{part}").__doc__
