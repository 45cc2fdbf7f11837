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


# -- one writer of the serving state -------------------------------------------------
CONTROLLER = "control.servingctl"  # ServingController: the one writer
SERVING = {"control.serving": "ServingState", "control.slots": "Slot"}
WRITE_SCOPE = ("control", "cluster", "state", "supervisor")
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft",
            "popitem", "remove", "clear", "update", "setdefault", "add", "discard", "sort",
            "reverse", "rotate"}


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _self_fields(tree: ast.Module) -> dict[str, set[str]]:
    """class -> the attributes its methods set on `self`."""
    out: dict[str, set[str]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names = out.setdefault(cls.name, set())
        for node in ast.walk(cls):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    names.add(t.attr)
    return out


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment, augmented assignment or del writes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    out: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        elif isinstance(t, ast.Starred):
            found.append(t.value)
        else:
            out.append(t)
    return out


def _serving_fields() -> set[str]:
    """The attributes of ServingState and Slot: the names their __init__ sets on
    self, with and without a leading underscore (a read-only property `x` is
    backed by `_x`)."""
    mods = _modules()
    names: set[str] = set()
    for mod, cls in SERVING.items():
        for name in _self_fields(_parse(mods[mod]))[cls]:
            names |= {name, name.lstrip("_"), "_" + name.lstrip("_")}
    return names


def _shared(fields: set[str], sources: dict[str, ast.Module]) -> set[str]:
    """Public field names that another class sets on its own self too (a job's
    `started`, a candidate's `version`): a write `x.version = ...` cannot be
    told apart by its name, so for these the read-only property is the check
    (a write raises AttributeError, and mypy refuses it:
    test_serving_fields_are_read_only_properties)."""
    shared: set[str] = set()
    for mod, tree in sources.items():
        for cls, names in _self_fields(tree).items():
            if SERVING.get(mod) != cls:
                shared |= {n for n in names & fields if not n.startswith("_")}
    return shared


def _serving_writes(sources: dict[str, ast.Module], fields: set[str]) -> list[str]:
    """Writes of the serving state's fields outside the controller: an
    assignment, augmented assignment or del of `x.<field>` or `x.<field>[k]`,
    or a mutating call `x.<field>.append(...)`, where x is not `self`."""
    watch = fields - _shared(fields, sources)
    found = []

    def field_of(e: ast.expr) -> str | None:
        if isinstance(e, ast.Subscript):
            e = e.value
        if (isinstance(e, ast.Attribute) and e.attr in watch
                and not (isinstance(e.value, ast.Name) and e.value.id == "self")):
            return e.attr
        return None

    for mod, tree in sources.items():
        if mod == CONTROLLER:
            continue
        for node in ast.walk(tree):
            for t in _targets(node):
                name = field_of(t)
                if name is not None:
                    found.append(f"{mod}:{node.lineno} writes {ast.unparse(t)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS and field_of(node.func.value)):
                found.append(f"{mod}:{node.lineno} changes {ast.unparse(node.func.value)}")
    return found


def _write_scope() -> dict[str, ast.Module]:
    return {m: _parse(p) for m, p in _modules().items() if _layer(m) in WRITE_SCOPE}


def test_only_the_controller_writes_the_serving_state():
    """ServingState's and Slot's fields are written by ServingController alone
    (control/servingctl.py): nowhere else in control/, cluster/, state/ or
    supervisor.py is one assigned, deleted, or changed in place."""
    fields = _serving_fields()
    assert {"replicas", "_replicas", "default_name", "probation", "slots", "record"} <= fields
    found = _serving_writes(_write_scope(), fields)
    assert found == [], "serving state written outside the controller:\n" + "\n".join(found)


def test_serving_fields_are_read_only_properties():
    """Every field of ServingState and Slot reads through a property with no
    setter (backed by `_name`): for everyone but the controller, read-only."""
    from control.serving import ServingState
    from control.slots import Slot

    mods = _modules()
    loose = []
    for mod, cls in ((m, c) for m, c in SERVING.items()):
        klass = {"ServingState": ServingState, "Slot": Slot}[cls]
        for name in sorted(_self_fields(_parse(mods[mod]))[cls]):
            public = name.lstrip("_")
            if public == "slots_view":  # the slots' read-only view, built once
                continue
            attr = getattr(klass, public, None)
            if not name.startswith("_") or not isinstance(attr, property) or attr.fset:
                loose.append(f"{cls}.{public}")
    assert loose == [], f"fields writable from outside: {loose}"


def test_the_write_check_can_fail():
    """The scan finds what the old code did: a slot's swap in the router, a
    counter bumped by the healer, a slot made by the applies, a field deleted."""
    fields = _serving_fields()
    old = ast.parse(
        "class Router:\n"
        "    def swap(self, slot, workers):\n"
        "        slot.replicas = workers\n"
        "        slot._stats_before_swap, x = None, 1\n"
        "class Healer:\n"
        "    def on_exit(self, w):\n"
        "        w.slot.replacing += 1\n"
        "        self.serving.exits.append(w)\n"
        "        slot = self.serving.slots[w.name] = object()\n"
        "        del self.serving.slots[w.name]\n"
        "        self.applying = 0\n")  # its own field: not the serving state's
    found = _serving_writes({"control.example": old}, fields)
    assert sorted(f.split(" ", 1)[1] for f in found) == [
        "changes self.serving.exits", "writes self.serving.slots[w.name]",
        "writes self.serving.slots[w.name]", "writes slot._stats_before_swap",
        "writes slot.replicas", "writes w.slot.replacing"], found


# -- composition: no part patched after construction ----------------------------------
def _patched_parts(tree: ast.Module) -> list[str]:
    """In supervisor.py: the names bound to a constructed part (`x = Cls(...)`,
    `self.x = y = f(...)`), then every assignment to an attribute of one."""
    parts: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            for t in _targets(node):
                if isinstance(t, (ast.Name, ast.Attribute)):
                    parts.add(ast.unparse(t))
    parts.discard("self")
    found = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) in parts:
                found.append(f"supervisor.py:{node.lineno} sets {ast.unparse(t)}")
    return found


def test_no_part_is_patched_after_construction():
    """supervisor.py builds each part with what it uses: no `node.jobs = ...`,
    `sup.keys = ...` or `self.rollouts.apply = ...` afterwards."""
    found = _patched_parts(_parse(_modules()["supervisor"]))
    assert found == [], "\n".join(found)
    # the check finds such a patch
    assert _patched_parts(ast.parse(
        "class S:\n"
        "    def __init__(self):\n"
        "        self.rollouts = RolloutControl()\n"
        "        node = ClusterNode()\n"
        "        self.rollouts.apply = f\n"
        "        node.jobs, node.pool = 1, 2\n")) != []


def _given_parts_patched(tree: ast.AST, where: str) -> list[str]:
    """Assignments, in a constructor, to an attribute of a part it was given
    (`policies.reusable = self.reusable`): one part patching another."""
    out = []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
            continue
        given = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self"}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if (isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name)
                            and el.value.id in given):
                        out.append(f"{where}:{node.lineno}: {el.value.id}.{el.attr}")
    return out


def test_no_part_patches_a_part_it_is_given():
    """No constructor in the service sets an attribute on a part it was given:
    what one part needs of another comes in through its own constructor."""
    found = []
    for name, path in _modules().items():
        found += _given_parts_patched(_parse(path), name)
    assert found == [], "\n".join(found)
    assert _given_parts_patched(ast.parse(
        "class J:\n"
        "    def __init__(self, policies, queue):\n"
        "        self.policies = policies\n"
        "        policies.reusable = self.reusable\n"), "x") == ["x:4: policies.reusable"]
