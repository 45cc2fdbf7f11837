"""The checkout's layout: tests and bench import what they use by its package
name, never by editing the module search path (the service's packages are
installed in editable mode, pyproject.toml; tests/, bench/ and deploy/ are
packages of the checkout, found from its root: pytest's rootdir for the
tests, `python -m bench.NAME` for the benchmarks), and no two modules of the
service's packages share a file name. Read from the source, no imports."""
from __future__ import annotations

import os
import re
import tomllib

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



def _service_modules() -> list[str]:
    """Every module file of the packages pyproject.toml installs, and its py-modules."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        setup = tomllib.load(fh)["tool"]["setuptools"]
    files = [os.path.join(ROOT, f"{m}.py") for m in setup.get("py-modules", [])]
    for pkg in setup["packages"]:
        files += _py_files(pkg.replace(".", os.sep))
    return files


def _shared_names(files: list[str]) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for path in files:
        name = os.path.basename(path)
        if name != "__init__.py":
            by_name.setdefault(name, []).append(os.path.relpath(path, ROOT))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_service_modules_share_a_name():
    files = _service_modules()
    assert any(f.endswith(os.path.join("control", "slots.py")) for f in files)  # the walk finds them
    assert _shared_names(files) == {}
    # the check can fail
    assert _shared_names(["/r/a/x.py", "/r/b/x.py", "/r/a/__init__.py", "/r/b/__init__.py"]) \
        == {"x.py": [os.path.relpath("/r/a/x.py", ROOT), os.path.relpath("/r/b/x.py", ROOT)]}
