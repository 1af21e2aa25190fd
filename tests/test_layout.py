"""The package's shape, from its own source: no import circle, a short top level, and modules
and functions short enough to read."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "envace_jax"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, modules) -> set[str]:
    """The package's modules `path` imports, at any depth of the file (function-level too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def test_no_module_imports_itself_back_through_others():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # Every package imports its own __init__ on the way in; only module-to-module edges count.
    graph = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in graph.items()}
    circles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_the_top_level_holds_few_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 6, loose


def test_modules_and_functions_stay_short():
    long_modules, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_modules.append(str(path.relative_to(PACKAGE)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 80:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert long_modules == [] and long_functions == []
