"""torchtpu's import graph (issue 51): no circle among module-level imports, so any module can be
imported first; the circles that function-local imports still close are the listed ones, each
a room still to split, and no new one. ``python tests/test_import_graph.py [ROOT]`` prints the
figures of a checkout."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles closed only through imports inside functions (deferred to dodge the circle): issue 51's
# remaining work. A circle not listed fails the test;
# a listed one that is gone must leave the list.
KNOWN_LOCAL_CIRCLES = [
]


def modules(root: Path) -> dict:
    """Dotted name (without ``torchtpu.``) -> path, for every module of the package."""
    found = {}
    for path in (root / "torchtpu").rglob("*.py"):
        parts = path.relative_to(root / "torchtpu").with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _target(name: str, known: dict) -> str | None:
    # ``from torchtpu.x import y``: the module x.y where y is one, else x (or its nearest parent).
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.AST, package: str, known: dict) -> list:
    names = []
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(p for p in [*parts, node.module or ""] if p)
        elif base.startswith("torchtpu"):
            base = base.removeprefix("torchtpu").lstrip(".")
        else:
            return []
        names = [f"{base}.{a.name}".lstrip(".") for a in node.names]
        names = [n if n in known else base for n in names]
    elif isinstance(node, ast.Import):
        names = [a.name.removeprefix("torchtpu").lstrip(".") for a in node.names
                 if a.name.split(".")[0] == "torchtpu"]
    return [t for t in (_target(n, known) for n in names) if t is not None]


def edges(root: Path) -> tuple[dict, dict]:
    """(module-level imports, imports inside functions): module -> the modules it imports."""
    known = modules(root)
    top, local = {}, {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        inside = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                into = local if id(node) in inside else top
                into.setdefault(name, set()).update(
                    t for t in _imported(node, package, known) if t != name)
    return top, local


def combined(top: dict, local: dict) -> dict:
    return {m: top.get(m, set()) | local.get(m, set()) for m in set(top) | set(local)}


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def test_no_circle_among_module_level_imports():
    top, _ = edges(ROOT)
    assert circles(top) == []


def test_function_local_imports_close_only_the_listed_circles():
    found = circles(combined(*edges(ROOT)))
    assert [c for c in found if c not in KNOWN_LOCAL_CIRCLES] == [], "a new circle"
    assert [c for c in KNOWN_LOCAL_CIRCLES if c not in found] == [], "gone: drop it from the list"


# The basement's rooms, bottom up, and the rooms each may import (function-local imports
# included): the runtime imports none, the compile cache and the TPU targets the runtime only
# (each plugs into it through runtime/hooks.py).
BASEMENT = {"runtime": set(), "cache": {"runtime"}, "targets": {"runtime"}}


def upward_imports(graph: dict, rooms: dict = BASEMENT) -> list:
    """(importer, imported) pairs where a room of ``rooms`` imports a room it may not."""
    def room(module: str) -> str | None:
        first = module.split(".")[0]
        return first if first in rooms else None

    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if room(m) and room(t) and room(t) != room(m) and room(t) not in rooms[room(m)])


def test_the_basement_rooms_import_downward_only():
    assert upward_imports(combined(*edges(ROOT))) == []


def scratch_package(root: Path, sources: dict) -> Path:
    """A package ``torchtpu`` under root with the given modules (path -> source), each folder a
    package: a tree for the checks to be seen failing on."""
    for path, source in {**sources, "__init__.py": ""}.items():
        file = root / "torchtpu" / path
        file.parent.mkdir(parents=True, exist_ok=True)
        (file.parent / "__init__.py").touch()
        file.write_text(source)
    return root


def test_the_room_check_sees_an_upward_import(tmp_path):
    scratch_package(tmp_path, {
        "cache/a.py": "from torchtpu.runtime import b\n",
        "runtime/b.py": "def f():\n    from torchtpu.targets import c\n",
        "targets/c.py": "from torchtpu.cache import a\n"})
    assert upward_imports(combined(*edges(tmp_path))) == [
        ("runtime.b", "targets.c"), ("targets.c", "cache.a")]


def test_the_scan_sees_a_circle_through_a_relative_import(tmp_path):
    scratch_package(tmp_path, {
        "eager/a.py": "from . import b\n",
        "eager/b.py": "from torchtpu.eager.c import x\n",
        "eager/c.py": "def f():\n    from torchtpu.eager import a\n"})
    top, local = edges(tmp_path)
    assert circles(top) == []
    assert circles(combined(top, local)) == [
        {"eager.a", "eager.b", "eager.c"}]


# The package's floors, bottom up: a module may import its own floor and those below, never one
# above (function-local imports included). A module's floor is the one naming the longest prefix
# of its dotted name (``tpu.tools`` before ``tpu``); every module must have one.
FLOORS = [
    # Leaf modules every floor may use: error categories, counters, import hooks, settings,
    # what every command line shares.
    ("errors", "metrics", "import_hooks", "settings", "commands"),
    ("runtime",),                       # the PJRT platform
    ("cache", "targets"),               # its rooms above it (the runtime helper's split)
    ("device",),
    ("profiler",),
    ("lowering",),
    ("eager",),
    ("kernels",),
    ("compile", "layers"),              # layers: scan_layers, one XLA loop under torch.compile
    ("distributed", "export"),
    # The public faces: torch.tpu, torchtpu.jax, torchtpu.pallas.
    ("tpu", "jax", "pallas"),
    # Adapters that import hooks apply inside other libraries' processes (vLLM, TRL, verl...):
    # they stay light and never pull in a tool. ``python -m torchtpu.titan`` is one's entry.
    ("integrations", "titan"),
    # Commands a person runs; a tool may drive an integration (serve or check through it), not
    # the reverse. ``torch.tpu.tools`` is the tools' face: torch.tpu loads it by name on first
    # use and never imports it, so it sits here, not on the faces' floor. The demo is a program
    # run the same way.
    ("tools", "tpu.tools", "aot", "diagnose", "doctor", "mcp", "onboard", "plan", "tune",
     "demo"),
    ("testing",),                       # serves the tests; nothing in the package imports it
    # The one composition root: it wires every floor into PyTorch (the integrations' import
    # hooks included), so it sits above all of them.
    ("", "_loader", "registration"),
]


def floor_of(module: str, floors: list = FLOORS) -> int | None:
    """The index of module's floor in floors, None when no floor names it."""
    best, found = -1, None
    for index, prefixes in enumerate(floors):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    return found


def imports_up(graph: dict, floors: list = FLOORS) -> list:
    """(importer, imported) pairs where a module imports one on a higher floor."""
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if floor_of(t, floors) > floor_of(m, floors))


def test_every_module_is_on_a_floor():
    assert [m for m in modules(ROOT) if floor_of(m) is None] == []


def test_no_import_goes_up_a_floor():
    assert imports_up(combined(*edges(ROOT))) == []


def test_nothing_outside_testing_imports_testing():
    graph = combined(*edges(ROOT))
    assert sorted((m, t) for m, targets in graph.items() for t in targets
                  if floor_of(t) == floor_of("testing") != floor_of(m)) == []


def test_the_floor_check_sees_an_import_up_inside_a_function(tmp_path):
    scratch_package(tmp_path, {
        "tools/a.py": "from torchtpu.device import b\n",
        "device/b.py": "def f():\n    from torchtpu.tpu import tools\n",
        "tpu/tools.py": "from torchtpu.tools import a\n"})
    floors = [("device",), ("tpu",), ("tools", "tpu.tools")]
    assert floor_of("tpu.tools", floors) == 2 and floor_of("tpu", floors) == 1
    assert imports_up(combined(*edges(tmp_path)), floors) == [("device.b", "tpu.tools")]



def _defined(tree: ast.Module) -> set | None:
    """The names a module defines at its top level (inside top-level ifs and trys too); None
    when it takes names it cannot list (``import *``, a module ``__getattr__``)."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(n for h in getattr(node, "handlers", []) for n in h.body)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def missing_names(root: Path) -> list:
    """``from torchtpu.x import y`` anywhere in torchtpu/, tests/ or bench/ where x is no module
    of the package, or y neither a submodule of x nor a name x defines: what a module moved
    without every importer following leaves behind (a function-local import fails only when
    called)."""
    known = modules(root)
    defined = {name: _defined(ast.parse(path.read_text())) for name, path in known.items()}
    found = []
    for folder in ("torchtpu", "tests", "bench"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and not node.level and node.module
                        and node.module.split(".")[0] == "torchtpu"):
                    continue
                base = node.module.removeprefix("torchtpu").lstrip(".")
                where = f"{path.relative_to(root)}:{node.lineno}"
                if base not in known:
                    found.append(f"{where}: no module {node.module}")
                    continue
                for alias in (a for a in node.names if a.name != "*"):
                    names = defined[base]
                    if (f"{base}.{alias.name}".lstrip(".") not in known and names is not None
                            and alias.name not in names):
                        found.append(f"{where}: {node.module} has no {alias.name}")
    return found


def test_every_torchtpu_import_names_a_module_or_a_name_that_exists():
    assert missing_names(ROOT) == []


def test_the_name_check_sees_an_importer_left_behind(tmp_path):
    scratch_package(tmp_path, {
        "cache/warm.py": "def read():\n    pass\n",
        "tools/a.py": "def f():\n    from torchtpu.runtime import warm\n",
        "tools/b.py": "from torchtpu.cache.warm import read, write\n"})
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench").mkdir()
    assert missing_names(tmp_path) == [
        "torchtpu/tools/a.py:2: no module torchtpu.runtime",
        "torchtpu/tools/b.py:1: torchtpu.cache.warm has no write"]

if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    top, local = edges(root)
    both = combined(top, local)
    print(f"modules {len(modules(root))}; imports between them: {sum(map(len, top.values()))} "
          f"module-level, {sum(len(local[m] - top.get(m, set())) for m in local)} inside "
          f"functions only")
    print(f"circles among module-level imports: {[sorted(c) for c in circles(top)]}")
    print(f"circles with those inside functions: {[sorted(c) for c in circles(both)]}")
    print(f"imports up a floor: {imports_up(both)}")
