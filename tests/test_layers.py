"""The layers the folders show: the engine imports nothing above it, the store reaches nothing of
torch, the UI imports no model library, and no modules import each other round a cycle."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dynchat"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions, as absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)   # `from . import x` may name a module
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in imports(p) if i in files and i != m} for m, p in files.items()}


def test_engine_imports_nothing_above_it():
    for path in (PACKAGE / "engine").rglob("*.py"):
        upward = {i for i in imports(path) if i.startswith("dynchat.") and not i.startswith("dynchat.engine")}
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}"


def test_store_knows_nothing_of_torch():
    g = graph()
    for top in ("dynchat.app.store",):
        seen, todo = set(), [top]
        while todo:               # everything the module reaches inside dynchat
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(g[m])
        for m in seen:
            path = PACKAGE.parent / (m.replace(".", "/") + ".py")
            path = path if path.exists() else path.with_suffix("") / "__init__.py"
            heavy = {i for i in imports(path) if i.split(".")[0] in ("torch", "transformers")}
            assert not heavy, f"{top} reaches {m}, which imports {sorted(heavy)}"


def test_ui_knows_nothing_of_models():
    heavy = {i for i in imports(PACKAGE / "app" / "ui.py") if i.split(".")[0] in ("torch", "transformers")}
    assert not heavy


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(g[m]):
            if n.rsplit(".", 1)[0] == m:      # a package importing its own submodule is not a cycle
                continue
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if not state.get(n):
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(g):
        if not state.get(m):
            visit(m, [m])
