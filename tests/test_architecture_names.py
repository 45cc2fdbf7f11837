"""Every code name ARCHITECTURE.md mentions exists in the repository.

The names are the inline code spans (`...`) of its prose; fenced blocks
(diagrams) are not read. Each span is classified by its shape, in this
order, and checked where a check is possible:

    literal    quotes, braces, brackets, `<placeholders>`, `=`, `->`, `|`,
               or a leading digit/sign/dot (`"partial": true`, `{t, id}`,
               `<models_dir>/.state.db`, `0600`): not checked
    route      starts with "/", or an HTTP method and "/" (`/apply`,
               `GET /status`): not checked
    error      `NNN code` (`409 memory_budget`): the code must occur as a
               string literal in the project's Python source
    env        ALL_CAPS starting with TEXTSWAP_ (`TEXTSWAP_REDIS_URL`): must
               occur as a string literal in the project's Python source
    config     `a.b[.c]` whose first part is a top-level key of
               state/config.py's DEFAULTS (`serving.replicas`), optionally
               followed by `: value` (`worker.zygote: false`): the key path
               must exist in DEFAULTS (a span that is also a module path,
               like `cluster.node`, passes as either)
    command    any other span with a space (`python supervisor.py`,
               `kill -9`): not checked
    path       holds "/" or ends in .py or .md (`control/routing.py`,
               `frontend/static/`): must exist under the repository root;
               another file name (`meta.json`) passes if it exists at the
               root and is not checked otherwise
    code       an identifier or a dotted one, with an optional trailing
               `()` or `(...)` (`PredictionLogBackend`, `Router.predict`,
               `apply_locked`, `state.store`): must be defined, see below

Definitions come from parsing the project's .py files with `ast` (the
service, bench/, deploy/, textswap_cli/; not .venv, not tests/, so the
document cannot lean on a test helper). Defined are: modules (by dotted
path), classes, functions and methods, names assigned at any level, and per
class its methods, class-level assignments and the `self.x` it assigns (a
class's members include those of its bases found in the project).

A dotted name resolves as a module prefix then its top-level names
(`control.routing.Router`; a module may be named by its last part when
that is unique: `textmodel.train_model`), or as a class and its members
(`Router.predict`, `WorkerHandle.stop` through `ChildProcess`); a dotted
name whose first part is not a class needs every part defined somewhere.
Pure text checks, no imports of the service.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field

from tests.helpers import ROOT

DOC = os.path.join(ROOT, "ARCHITECTURE.md")
SKIP_DIRS = {".venv", "tests", ".git", "node_modules", "__pycache__", "models", ".ci"}
FENCE = re.compile(r"^\s*(```|~~~)")
SPAN = re.compile(r"(`+)(.+?)\1")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CODE = re.compile(rf"^{IDENT}(\.{IDENT})*(\(\)|\(\.\.\.\))?$")
CONFIG = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?:: \S.*)?$")
ERROR = re.compile(r"^[1-5]\d\d ([a-z_]+)$")
ENV = re.compile(r"^TEXTSWAP_[A-Z0-9_]+$")
HTTP_ROUTE = re.compile(r"^(GET|POST|PUT|DELETE|HEAD|PATCH)(/(GET|POST|PUT|DELETE|HEAD|PATCH))* /")
LITERAL = re.compile(r"[\"'{}\[\]<>=|]|->|^[-+.\d]")


# -- the project's definitions ---------------------------------------------------------
@dataclass
class Index:
    modules: set[str] = field(default_factory=set)            # "control.routing"
    top: dict[str, set[str]] = field(default_factory=dict)    # module -> top-level names
    names: set[str] = field(default_factory=set)              # every defined name
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> members
    bases: dict[str, set[str]] = field(default_factory=dict)  # class -> base class names
    strings: set[str] = field(default_factory=set)            # every str literal
    short: dict[str, str] = field(default_factory=dict)       # "routing" -> "control.routing"

    def members(self, cls: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set(self.classes.get(cls, ()))
        for base in self.bases.get(cls, ()):
            if base not in seen:
                out |= self.members(base, seen | {cls})
        return out


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _names_in(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _names_in(t)]
    return []


def _self_attrs(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
            and target.value.id in ("self", "cls"):
        return [target.attr]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _self_attrs(t)]
    return []


def _add_file(index: Index, mod: str, tree: ast.Module) -> None:
    index.modules.add(mod)
    parts = mod.split(".")
    for i in range(1, len(parts)):  # packages on the way
        index.modules.add(".".join(parts[:i]))
    top: set[str] = index.top.setdefault(mod, set())
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            top.add(node.name)
        for t in _targets(node):
            top.update(_names_in(t))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            index.strings.add(node.value)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            index.names.add(node.name)
        for t in _targets(node):
            index.names.update(_names_in(t))
            index.names.update(_self_attrs(t))
        if isinstance(node, ast.ClassDef):
            index.names.add(node.name)
            members = index.classes.setdefault(node.name, set())
            index.bases.setdefault(node.name, set()).update(
                b.id if isinstance(b, ast.Name) else b.attr
                for b in node.bases if isinstance(b, (ast.Name, ast.Attribute)))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                for t in _targets(item):
                    members.update(_names_in(t))
            for sub in ast.walk(node):
                for t in _targets(sub):
                    members.update(_self_attrs(t))


def build_index(root: str = ROOT) -> Index:
    index = Index()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(folder, fn)
            rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            mod = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            with open(path, encoding="utf-8") as f:
                _add_file(index, mod, ast.parse(f.read(), path))
    last: dict[str, list[str]] = {}
    for mod in index.modules:
        last.setdefault(mod.rpartition(".")[2], []).append(mod)
    index.short = {k: v[0] for k, v in last.items() if len(v) == 1}  # unique last parts only
    return index


def config_defaults(root: str = ROOT) -> dict:
    """state/config.py's DEFAULTS, read as a literal (no import)."""
    path = os.path.join(root, "state", "config.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            names = [n for t in _targets(node) for n in _names_in(t)]
            if "DEFAULTS" in names and node.value is not None:
                src = ast.unparse(node.value)
                return eval(src, {"__builtins__": {}}, {})  # literal dicts and arithmetic
    raise AssertionError("state/config.py defines no DEFAULTS")


# -- the document's spans ------------------------------------------------------------------
def spans(text: str) -> list[tuple[int, str]]:
    """(line number, span) of every inline code span outside fenced blocks."""
    out, fenced = [], False
    for no, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out += [(no, m.group(2).strip()) for m in SPAN.finditer(line)]
    return out


def classify(span: str, config_top: set[str]) -> str:
    if span.startswith("/") or HTTP_ROUTE.match(span):
        return "route"
    if ERROR.match(span):
        return "error"
    if ENV.match(span):
        return "env"
    m = CONFIG.match(span)
    if m and m.group(1).split(".")[0] in config_top:
        return "config"
    if LITERAL.search(span):
        return "literal"
    if " " in span:
        return "command"
    if "/" in span or span.endswith((".py", ".md")):
        return "path"
    if re.search(r"\.(json|jsonl|yaml|yml|toml|txt|db|keras|conf|ini|cfg)$", span):
        return "file"
    if CODE.match(span):
        return "code"
    return "other"


def _in_tree(tree: dict, parts: list[str]) -> bool:
    node = tree
    for p in parts:
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def code_name_exists(name: str, index: Index) -> bool:
    name = re.sub(r"\((\.\.\.)?\)$", "", name)
    parts = name.split(".")
    short = index.short.get(parts[0])
    if len(parts) > 1 and parts[0] not in index.modules and short:
        parts = short.split(".") + parts[1:]  # `textmodel.train_model`
    # a module, or a module prefix and what it defines (then class members)
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in index.modules:
            rest = parts[i:]
            if not rest:
                return True
            if rest[0] not in index.top.get(mod, set()):
                return False
            return _members_exist(rest, index)
    if parts[0] not in index.names:
        return False
    return _members_exist(parts, index)


def _members_exist(parts: list[str], index: Index) -> bool:
    head, rest = parts[0], parts[1:]
    if not rest:
        return True
    if head in index.classes:
        if rest[0] not in index.members(head):
            return False
        return _members_exist(rest, index) if rest[0] in index.classes else all(
            p in index.names for p in rest[1:])
    return all(p in index.names for p in rest)


def problems(text: str, root: str = ROOT, index: Index | None = None,
             defaults: dict | None = None) -> list[str]:
    """What in `text` names something the repository does not have."""
    index = index or build_index(root)
    defaults = defaults if defaults is not None else config_defaults(root)
    top = set(defaults)
    bad = []
    for no, span in spans(text):
        kind = classify(span, top)
        ok = True
        if kind == "error":
            ok = ERROR.match(span).group(1) in index.strings
        elif kind == "env":
            ok = span in index.strings
        elif kind == "config":
            key = CONFIG.match(span).group(1)
            ok = _in_tree(defaults, key.split(".")) or code_name_exists(key, index)
        elif kind == "path":
            ok = os.path.exists(os.path.join(root, span.rstrip("/")))
        elif kind == "code":
            ok = code_name_exists(span, index)
        if not ok:
            bad.append(f"line {no}: `{span}` ({kind}) not found")
    return bad


# -- the tests -------------------------------------------------------------------------------
def test_every_code_name_in_architecture_md_exists():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    found = problems(text)
    assert not found, "ARCHITECTURE.md names what the code does not have:\n" + "\n".join(found)


def test_the_check_catches_made_up_names():
    index, defaults = build_index(), config_defaults()
    good = ("`control/routing.py` `Router.predict` `PredictionLogBackend` `apply_locked` "
            "`WorkerHandle.stop` `control.routing.Router` `serving.replicas` "
            "`worker.zygote: false` `409 memory_budget` `TEXTSWAP_REDIS_URL` `/apply` "
            "`python supervisor.py` `\"partial\": true` `Storage.write()`")
    assert problems(good, index=index, defaults=defaults) == []
    made_up = ["`control/routeing.py`", "`Router.predikt`", "`PredictionLogBackends`",
               "`apply_unlocked`", "`serving.replicaz`", "`409 memory_budgett`",
               "`TEXTSWAP_NO_SUCH_VAR`", "`control.routing.Routr`", "`Slot.swap_everything`",
               "`cluster.redis_urll`", "`textmodel.no_such_function`"]
    for span in made_up:
        assert len(problems(f"Some prose with {span} in it.\n", index=index,
                            defaults=defaults)) == 1, span
    # fenced blocks are diagrams, not names
    assert problems("```\n`NoSuchName`\n```\n", index=index, defaults=defaults) == []


def test_spans_are_classified_by_shape():
    top = {"serving", "worker", "cluster"}
    assert [classify(s, top) for s in (
        "/predict", "409 quality_gate", "TEXTSWAP_TEST_FAULT", "serving.replicas",
        "worker.zygote: false", "<models_dir>/.state.db", "control/slots.py", "kill -9",
        "meta.json", "Router.swap", "apply_locked")] == [
        "route", "error", "env", "config", "config", "literal", "path", "command",
        "file", "code", "code"]


def test_the_document_is_short_and_self_contained():
    """At most 250 lines, and every reference stays inside the repository:
    no parent-folder paths, no issue numbers, no links out."""
    with open(DOC, encoding="utf-8") as fh:
        text = fh.read()
    assert len(text.splitlines()) <= 250
    assert "../" not in text
    assert not re.search(r"\bissue\s*#?\d", text, re.I)
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert "://" not in target, target
        assert os.path.exists(os.path.join(ROOT, target.split("#")[0])), target
