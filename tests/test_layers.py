"""The house stays as built: imports point down the layers only, and no module imports itself in a cycle.

    spes.errors  <  spes.cli  <  spes.config  <  spes.model | spes.data | spes.storage  <  spes.sync  <  spes.train | spes.eval
                 <  spes.plan  <  spes.run  <  spes.round  <  spes.members  <  pipelines  <  stages

A module may import from its own package and from any lower layer, never from a sibling package of its own
layer or from above. Function-level imports count the same as top-level ones (they are how cycles hide).
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [
    ("spes.errors",),
    ("spes.cli",),
    ("spes.config",),
    ("spes.model", "spes.data", "spes.storage"),
    ("spes.sync",),
    ("spes.train", "spes.eval"),
    ("spes.plan",),
    ("spes.run",),
    ("spes.round",),
    ("spes.members", "spes.policy"),
    ("pipelines",),
    ("stages",),
]


def _package(module: str) -> tuple[int, str]:
    if module == "spes":  # the package itself: a docstring, nothing imported
        return 0, "spes"
    for i, layer in enumerate(LAYERS):
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return i, pkg
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _modules() -> dict[str, str]:
    out = {}
    for top in ("spes", "pipelines", "stages"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    out[mod] = path
    return out


def _imports(path: str, module: str) -> set[str]:
    """Every project module `path` imports, at any depth of the file."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import
                parts = module.split(".")[: -node.level]
                base = ".".join(parts + [node.module])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in ("spes", "pipelines", "stages")}


MODULES = _modules()
GRAPH = {m: {i for i in _imports(p, m) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for m in MODULES:
        _package(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    layer, pkg = _package(module)
    bad = []
    for imp in sorted(GRAPH[module]):
        il, ipkg = _package(imp)
        if ipkg != pkg and il >= layer:
            bad.append(imp)
    assert not bad, f"{module} imports {bad} from its own layer or above (layers: {LAYERS})"


def test_no_import_cycles():
    """Between modules (a package's __init__ importing its own modules is no cycle in this sense)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if n == m.rpartition(".")[0] or m == n.rpartition(".")[0] and MODULES[m].endswith("__init__.py"):
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if not state.get(n):
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if not state.get(m):
            visit(m)


def test_library_imports_no_orchestration():
    """spes/ is pure PyTorch: no Prefect, no DVC."""
    for m, path in MODULES.items():
        if m.startswith("spes"):
            tree = ast.parse(open(path, encoding="utf-8").read())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not names & {"prefect", "dvc"}, f"{m} imports {names & {'prefect', 'dvc'}}"
