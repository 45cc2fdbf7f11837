"""The checkout's layout: tests and bench import what they use by its package
name, never by editing the module search path (the service's packages are
installed in editable mode, pyproject.toml; tests/, bench/ and deploy/ are
packages of the checkout, found from its root: pytest's rootdir for the
tests, `python -m bench.NAME` for the benchmarks). Read from the source, no imports."""
from __future__ import annotations

import os
import re

from tests.helpers import ROOT

# the search path's insert / append / extend, a slice or item assigned, = and +=
# (the pattern spelt in two pieces so that this file does not match itself)
PATH_EDIT = re.compile(r"\bsys\.pa" r"th\s*(\.\s*(insert|append|extend)\s*\(|\[[^\]]*\]\s*=|\+?=(?!=))")


def _py_files(folder: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d not in {"__pycache__", "results", ".cache"}]
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(out)


def test_the_pattern_finds_path_edits():
    edits = ["sys.pa" "th.insert(0, ROOT)", "sys.pa" "th[:0] = [ROOT]", "sys.pa" "th.append(x)",
             "'import sys; sys.pa" "th[:0] = [sys.argv[1]]'", "sys.pa" "th += [x]"]
    assert all(PATH_EDIT.search(e) for e in edits)
    assert not any(PATH_EDIT.search(s) for s in ["sys.meta_path[:] = []", "print(sys.pa" "th)",
                                                  "sys.pa" "th == x"])


def test_no_module_search_path_edits_in_tests_bench_or_deploy():
    found = []
    for folder in ("tests", "bench", "deploy"):
        for path in _py_files(folder):
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if PATH_EDIT.search(line):
                        found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not found, "import by package name instead (tests.X, bench.X, deploy.X):\n" + \
        "\n".join(found)

