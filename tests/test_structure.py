"""The package's shape, checked by parsing its source: imports only go downward (and never in a
cycle), modules stay small, collaborators are typed, and policy names are compared only as
``names`` members."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tiered_kv import names

PACKAGE = Path(__file__).resolve().parents[1] / "tiered_kv"
ROOT_MODULES = {"errors", "config", "names", "platform", "_checks", "hugepages", "__init__"}
# cli > engine, sim, bench > cache > tree, transfer, host > device, storage > kernels > root
RANK = {
    "root": 0,
    "kernels": 1,
    "device": 2,
    "storage": 2,
    "host": 3,
    "tree": 3,
    "transfer": 3,
    "cache": 4,
    "engine": 5,
    "sim": 5,
    "bench": 5,
    "integrations": 5,
    "cli": 6,
}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        out[".".join(("tiered_kv", *rel.parts))] = path
    return out


def group(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 2 or parts[1] in ROOT_MODULES:
        return "root"
    return parts[1]


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(module imported, line, at module level) for every tiered_kv import in ``path``,
    including those inside functions and ``if TYPE_CHECKING`` blocks."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("tiered_kv"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    out.append((full, node.lineno, id(node) in top))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tiered_kv"):
                    out.append((alias.name, node.lineno, id(node) in top))
    return out


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` refers to (``from a.b import c`` may name a module or an object)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_imports_only_go_downward():
    known = modules()
    bad = []
    for mod, path in known.items():
        g = group(mod)
        for name, line, _ in imports_of(path):
            target = resolve(name, known)
            if target is None:
                continue
            tg = group(target)
            if tg == g:
                continue
            if RANK[tg] >= RANK[g]:
                bad.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} ({g}) imports {target} ({tg})"
                )
    assert not bad, "imports that do not go downward:\n" + "\n".join(bad)


def test_no_import_cycle():
    known = modules()
    graph = {
        mod: {t for n, _, _ in imports_of(p) if (t := resolve(n, known)) and t != mod}
        for mod, p in known.items()
    }
    # A package's __init__ re-exports its modules; an edge into it stands for those modules.
    for mod in graph:
        graph[mod] = {
            t for t in graph[mod] if not (t.endswith("__init__") or mod.endswith("__init__"))
        }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_modules_are_small():
    sizes = {
        str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    big = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_constructors_type_their_collaborators():
    """No ``__init__`` parameter is typed ``Any`` or left untyped (bar ``self``, ``*args``)."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                args = node.args.posonlyargs + node.args.args[1:] + node.args.kwonlyargs
                for a in args:
                    text = ast.unparse(a.annotation) if a.annotation is not None else None
                    if text is None or text == "Any" or "Any" in text.replace("|", " ").split():
                        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                        bad.append(f"{where} {a.arg}: {text}")
    assert not bad, "constructor collaborators without a real type:\n" + "\n".join(bad)


VOCABULARY = {
    v
    for cls in (
        names.WritePolicy,
        names.PrefetchPolicy,
        names.EvictionPolicyName,
        names.HostLayout,
        names.IOBackend,
        names.Direction,
        names.ModelKind,
    )
    for v in cls.values()
}


def test_policy_names_are_compared_only_as_members():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    if isinstance(side, ast.Constant) and side.value in VOCABULARY:
                        bad.append(
                            f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {side.value!r}"
                        )
    assert not bad, "vocabulary strings compared by hand:\n" + "\n".join(bad)


@pytest.mark.parametrize("cls", [names.WritePolicy, names.Direction, names.HostLayout])
def test_names_parse_and_reject(cls):
    for v in cls.values():
        assert names.parse(cls, v, "x") is cls(v) and cls(v) == v
    with pytest.raises(names.InvalidArgumentError, match=r"x='nope' is invalid: use one of"):
        names.parse(cls, "nope", "x")


def test_every_module_has_its_sentence_in_structure_md():
    doc = (PACKAGE.parent / "docs" / "structure.md").read_text()
    missing = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" and len(rel.parts) > 1:
            continue  # a package's __init__ re-exports; the package has its heading
        name = "/".join(rel.parts[-2:]) if rel.parts[-2:-1] == ("allocator",) else path.name
        if f"`{name}`" not in doc:
            missing.append(str(rel))
    assert not missing, f"modules without a row in docs/structure.md: {missing}"
