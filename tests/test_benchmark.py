"""The benchmark runner: one registry whose every entry loads, a docstring per suite as its help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.benchmark import GROUPS, SUITES, main
from distillspec.cli import run_main

from .conftest import ROOT, run_here


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_registered_suite_loads_and_says_what_it_measures(name):
    suite = SUITES[name]
    assert callable(suite.load())
    assert (ROOT / "benchmarks" / "suites" / f"{suite.module}.py").exists()
    assert f"``{name}``" in suite.doc() or suite.kind == "command", f"{suite.module}.py does not describe {name}"
    assert suite.summary()


def test_groups_name_registered_suites_only():
    assert {s for group in GROUPS.values() for s in group} <= set(SUITES)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/benchmark.py", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_the_runner_lists_explains_and_refuses_in_one_line(capsys, monkeypatch):
    def here(*args: str) -> subprocess.CompletedProcess:  # the script's entry point, in this process
        return run_here(lambda: run_main(main), capsys, monkeypatch, argv=["benchmarks/benchmark.py", *args])

    listed = here("--list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in SUITES)
    helped = here("trace", "--help")
    assert helped.returncode == 0 and "benchmarks/suites/transport.py" in helped.stdout
    assert "Suite ``trace``" in helped.stdout
    unknown = here("nosuch")
    assert unknown.returncode == 2 and "unknown suite(s) ['nosuch']" in unknown.stderr
    mixed = here("async", "speed")
    assert mixed.returncode == 2 and "suite speed takes options of its own" in mixed.stderr
    own = here("speed", "--help")  # passed on to the suite's own command line
    assert own.returncode == 0 and "--draft-vocab" in own.stdout
    # The suite's own distill job is online, so rollout.online_mix passes validation and the next check speaks
    mixed_online = here("online", "rollout.online_mix=0.5", "dataset=/nonexistent")
    assert mixed_online.returncode != 0 and "dataset path '/nonexistent' does not exist" in mixed_online.stderr
    empty = run("online", "--distinct", "0")  # as a user runs it: refused before a model loads or Ray starts
    assert empty.returncode != 0 and "--clients and --distinct: at least 1" in empty.stderr
    assert "Traceback" not in empty.stderr
    # A suite run as its own module, as its docstring shows: the same one line.
    module = [sys.executable, "-m", "benchmarks.suites.target_kernel", "--layouts", "int4"]
    alone = subprocess.run(module, cwd=ROOT, capture_output=True, text=True, check=False)
    assert alone.returncode == 2 and alone.stderr.startswith("error: --layouts takes two or more"), alone.stderr
    assert "Traceback" not in alone.stderr
