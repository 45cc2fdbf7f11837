"""The service's layers import downward only, and no module imports itself in
a circle (ARCHITECTURE.md, "Layers"). Read from the source with `ast`, so the
check costs no imports: every `import` counts, also the ones inside functions;
only `if TYPE_CHECKING:` blocks (type hints, never run) are left out."""
from __future__ import annotations

import ast
import os

from tests.helpers import ROOT

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


def _imports(mod: str, path: str, known: set[str], type_hints: bool = False) -> set[str]:
    """The project modules that `mod` imports (resolved to the longest known name);
    type_hints: the `if TYPE_CHECKING:` imports too."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skip = set() if type_hints else _type_checking_lines(tree)
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


def _graph(type_hints: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods), type_hints) for m, p in mods.items()}


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


def test_no_circles_among_the_frontends_modules_even_through_type_hints():
    """A Protocol lives with the module that uses it: the frontend's modules
    import each other in no circle, not even through `if TYPE_CHECKING:`."""
    graph = _graph(type_hints=True)
    assert "frontend.service" in graph["frontend.app"]  # the type-hint imports are read
    frontend = {m: {d for d in deps if _layer(d) == "frontend"}
                for m, deps in graph.items() if _layer(m) == "frontend"}
    assert _cycles(frontend) == []


def test_the_checks_can_fail():
    """The two checks on a made-up graph: a circle and an upward edge are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert LAYERS[_layer("state.store")] < LAYERS[_layer("control.slots")]
    # a real module's imports are read: the supervisor composes the control plane
    assert "control.routing" in _graph()["supervisor"]


# -- the parts of the control plane and what they are given ---------------------------
PARTS = ("control", "cluster", "state")  # the control plane and the backends


def _part_files() -> dict[str, str]:
    return {m: p for m, p in _modules().items() if _layer(m) in PARTS}


def test_no_part_takes_the_supervisor():
    """No module of the control plane or the backends imports the supervisor
    (type hints included), names a parameter `sup`/`supervisor`, or reaches
    through an attribute of that name: each part is given what it uses."""
    found = []
    for mod, path in _part_files().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == \
                    "supervisor" or isinstance(node, ast.Import) and any(
                        a.name.split(".")[0] == "supervisor" for a in node.names):
                found.append(f"{mod}:{node.lineno} imports the supervisor")
            elif isinstance(node, ast.arg) and node.arg in ("sup", "supervisor"):
                found.append(f"{mod}:{node.lineno} takes `{node.arg}`")
            elif isinstance(node, ast.Attribute) and node.attr in ("sup", "supervisor"):
                found.append(f"{mod}:{node.lineno} reaches through `.{node.attr}`")
    assert found == [], "\n".join(found)


def _given(path: str) -> dict[str, set[str]]:
    """class -> the project classes its __init__ is given (annotated parameters)
    or declares as attributes set at composition (annotated `self.x: T`)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out: dict[str, set[str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                names = {ast.unparse(a.annotation).strip("\"'") for a in fn.args.args
                         if a.annotation is not None}
                names |= {ast.unparse(n.annotation).strip("\"'") for n in ast.walk(fn)
                          if isinstance(n, ast.AnnAssign)}
                out[cls.name] = {n for n in names if n[:1].isupper()}
    return out


def _uses() -> dict[str, set[str]]:
    """The control plane's classes and the classes each is given. The
    settings (state/config.py's Config and its sections) are data that any
    part may be given, not a part."""
    given: dict[str, set[str]] = {}
    for mod, path in _part_files().items():
        if mod != "state.config":
            given.update(_given(path))
    return {c: {d for d in deps if d in given and d != c} for c, deps in given.items()}


def test_the_parts_given_to_each_other_form_no_circle():
    """What each part of the control plane is given (its constructor's typed
    parameters and attributes) draws a graph without a circle: a part that
    must call back into one that holds it is given a function, not the part
    (the rollouts' `apply`, the provisioner's `end_probation`, the router's
    `on_failing`)."""
    uses = _uses()
    assert {"Applies", "RolloutControl", "Healer", "Router", "Provisioner", "RecordKeeper",
            "StatusView", "JobManager", "ClusterNode"} <= set(uses)
    assert "RolloutControl" in uses["Applies"] and "RecordKeeper" in uses["Healer"]
    assert _cycles(uses) == []
    # the request path reads the serving state and holds no control-plane part:
    # what it reports goes through the function it was given (`on_failing`)
    assert uses["Router"] == {"ServingState"}, uses["Router"]


def test_the_serving_state_has_one_owner():
    """The slots, the default model and the record are attributes of
    ServingState only: no other class of the control plane keeps its own."""
    owned = {"slots", "default_name", "previous_default", "record"}
    found = []
    for mod, path in _part_files().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if cls.name == "ServingState":
                continue
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign) else [])
                for t in targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self" and t.attr in owned):
                        found.append(f"{mod}.{cls.name} sets self.{t.attr}")
    # the cluster client's cache of the Redis record is its own (cluster/record.py)
    assert [f for f in found if not f.startswith("cluster.record.Cluster ")] == [], found
