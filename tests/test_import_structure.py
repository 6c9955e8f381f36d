"""The package's import structure (issue 16): no import cycles among autoshard's modules -- imports inside
functions count, since they only hide a cycle -- no module imports another module's private name, and no
autoshard module is imported inside a function.
"""
import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict:
    out = {}
    for path in (ROOT / "autoshard").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules) -> list:
    """(importer, imported module, name) for every `from ... import name` of an autoshard module."""
    found = []
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.append((name, full if full in modules else target, alias.name))
    return [(a, b, n) for a, b, n in found if b.startswith("autoshard")]


def _cycles(modules, imports) -> list:
    graph = collections.defaultdict(set)
    for importer, imported, _ in imports:
        if imported != importer and not imported.startswith(importer + "."):  # a package's own submodules
            graph[importer].add(imported)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))
    for module in sorted(modules):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_import_cycles():
    modules = _modules()
    assert _cycles(modules, _imports(modules)) == []


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    private = [(a, b, n) for a, b, n in _imports(modules) if n.startswith("_") and not n.startswith("__")
               and b in modules and b != a]
    assert private == []


def _imports_autoshard(node) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").startswith("autoshard")
    return isinstance(node, ast.Import) and any(alias.name.startswith("autoshard") for alias in node.names)


def test_no_function_level_imports_of_autoshard_modules():
    """Imports inside functions hide cycles and import order; they are kept for optional dependencies only
    (transformers, matplotlib, ...), never for autoshard's own modules."""
    nested = []
    for name, path in _modules().items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested += [f"{name}:{node.lineno}" for node in ast.walk(fn) if _imports_autoshard(node)]
    assert sorted(set(nested)) == []


def test_lower_layers_do_not_import_the_compiler():
    """ir/ is the vocabulary every stage shares and imports nothing else of autoshard; runtime/ runs on the
    ranks and needs only ir/, cost/ and itself (never the passes, the plan or the program)."""
    allowed = {"autoshard.ir": ("autoshard.ir",), "autoshard.runtime": ("autoshard.ir", "autoshard.cost",
                                                                     "autoshard.runtime")}
    modules = _modules()
    wrong = [(a, b) for a, b, _ in _imports(modules) for layer, ok in allowed.items()
             if a.startswith(layer) and not any(b == p or b.startswith(p + ".") for p in ok)]
    assert wrong == []


# The package order (issue 30): a package imports only packages of earlier layers (or itself). It reads top to
# bottom as the compile does: the shared vocabulary, the runtime library and the sharding rules; the cost model,
# then the solver on it; reports and weights; tracing; the plan as a value; the passes that decide it; the
# lowering that builds what a rank runs; the catalogue and the program; the searches over programs; the public
# entry point, verification and the command line. The runtime sits low, not after the program: it is the library
# the lowered ranks call and imports only ir/ (test_lower_layers_do_not_import_the_compiler). The zoo stands
# outside: it imports the package, and nothing in the package imports it.
LAYERS = [
    {"ir"},
    {"runtime", "strategies"},
    {"cost"},
    {"solver"},
    {"report", "weights"},
    {"frontend"},
    {"plan"},
    {"passes"},
    {"lowering"},
    {"catalogue", "program"},
    {"search"},
    {"api"},
    {"verify"},
    {"__main__", "apidoc", "demo", "__init__"},
]
OUTSIDE = {"zoo"}


def _package(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_packages_import_only_earlier_layers():
    modules = _modules()
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    packages = {_package(m) for m in modules}
    assert packages <= set(layer) | OUTSIDE, f"place these packages in LAYERS: {packages - set(layer) - OUTSIDE}"
    wrong = []
    for importer, imported, _ in _imports(modules):
        a, b = _package(importer), _package(imported)
        if a == b or a in OUTSIDE:
            continue
        if b in OUTSIDE:
            if a != "demo":  # the demo runs a zoo model
                wrong.append((importer, imported))
        elif layer[b] >= layer[a] and layer[a] != len(LAYERS) - 1:  # the entry points import one another
            wrong.append((importer, imported))
    assert wrong == []
