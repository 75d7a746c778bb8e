"""The house rules that a change can break without failing any other test: no import cycle
inside the package, kernels independent of the test harnesses and the reference, no file over
700 lines."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "replayssm"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set:
    """Modules of the package that `path` imports (at any depth: lazy imports count too)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("replayssm"))
    return found


def _graph() -> dict:
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        # an import of `a.b.c` depends on the module a.b.c (or on the package a.b if c is a name)
        deps = set()
        for target in _imports(path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def test_no_import_cycle():
    graph = _graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in graph[node]:
            # a package importing its own submodules is not a cycle of code
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                if not all(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(cycle, cycle[1:])):
                    raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_kernels_import_neither_testing_nor_reference():
    for path in (PKG / "ops").rglob("*.py"):
        bad = {m for m in _imports(path) if m.startswith(("replayssm.testing", "replayssm.reference"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_no_file_over_700_lines():
    files = [p for p in list(PKG.rglob("*.py")) + list((ROOT / "tests").glob("*.py"))
             + list((ROOT / "benchmarks").rglob("*.py")) + list((ROOT / "docs").rglob("*.md"))]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 700}
    assert not long, long
