"""The service's layers import downward only, and no module imports itself in
a circle (ARCHITECTURE.md, "Layers"). Read from the source with `ast`, so the
check costs no imports: every `import` counts, also the ones inside functions;
only `if TYPE_CHECKING:` blocks (type hints, never run) are left out."""
from __future__ import annotations

import ast
import os

from helpers import ROOT

# lower number = lower layer; a module may import its own layer and the ones below
LAYERS = {
    "state": 0,         # errors, config, store, state DB, training data
    "model_worker": 1,  # the processes that import TensorFlow (and their protocol)
    "control": 2,       # the control plane: slots, pool, routing, applies, rollouts, ...
    "cluster": 3,       # the cluster backend (Redis)
    "frontend": 4,      # Tornado handlers and apps
    "supervisor": 5,    # the entry point and composition root
}
CLI = "textswap_cli"    # talks HTTP to the service: imports none of it


def _modules() -> dict[str, str]:
    """module name -> file, for every service module and the CLI."""
    found = {"supervisor": os.path.join(ROOT, "supervisor.py")}
    for pkg in [*LAYERS, CLI]:
        folder = os.path.join(ROOT, pkg)
        if not os.path.isdir(folder):
            continue
        for fn in sorted(os.listdir(folder)):
            if fn.endswith(".py"):
                mod = pkg if fn == "__init__.py" else f"{pkg}.{fn[:-3]}"
                found[mod] = os.path.join(folder, fn)
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    if hasattr(inner, "lineno"):
                        lines.add(inner.lineno)
    return lines


def _imports(mod: str, path: str, known: set[str]) -> set[str]:
    """The project modules that `mod` imports (resolved to the longest known name)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(p for p in [*parts, base] if p)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _layer(mod: str) -> str:
    return mod.split(".")[0]


def test_every_layer_is_known_and_the_root_holds_only_the_entry_point():
    stray = [fn for fn in os.listdir(ROOT) if fn.endswith(".py") and fn != "supervisor.py"]
    assert stray == [], f"Python modules at the repository root besides supervisor.py: {stray}"
    assert len(_modules()) > 40  # the walk found the packages


def test_imports_point_down_only():
    upward = []
    for mod, deps in _graph().items():
        for dep in deps:
            if _layer(mod) == CLI or _layer(dep) == CLI:
                if _layer(mod) != _layer(dep):
                    upward.append(f"{mod} -> {dep} (the CLI and the service share no code)")
                continue
            if LAYERS[_layer(dep)] > LAYERS[_layer(mod)]:
                upward.append(f"{mod} (layer {_layer(mod)}) -> {dep} (layer {_layer(dep)})")
    assert upward == [], "upward imports:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_the_checks_can_fail():
    """The two checks on a made-up graph: a circle and an upward edge are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert LAYERS[_layer("state.store")] < LAYERS[_layer("control.slots")]
    # a real module's imports are read: the supervisor composes the control plane
    assert "control.routing" in _graph()["supervisor"]
