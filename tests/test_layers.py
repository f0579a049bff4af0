"""The layers import one way, no module imports itself back through others, and no module
reaches into another's private names.

errors, memory, version (leaves) < config < graphs.models < graphs.phases, graphs.kernels <
graphs.backends < runtime < io < api < the package, server < bench < cli. Every import counts,
lazy ones inside functions included. The model math (phases) and the kernels never import each
other: a backend hands the kernels to the math through ``Ops``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import neuronfx

ROOT = Path(neuronfx.__file__).parent

RANKS = {
    "neuronfx.version": 0, "neuronfx.errors": 0, "neuronfx.memory": 0,
    "neuronfx.config": 1,
    "neuronfx.graphs": 2, "neuronfx.graphs.models": 2, "neuronfx.graphs.phases": 3, "neuronfx.graphs.kernels": 3,
    "neuronfx.graphs.backends": 4,
    "neuronfx.runtime": 5, "neuronfx.io": 6, "neuronfx.api": 7,
    "neuronfx": 8, "neuronfx.__main__": 10, "neuronfx.server": 8, "neuronfx.bench": 9, "neuronfx.cli": 10,
}

FORBIDDEN = {("neuronfx.graphs.phases", "neuronfx.graphs.kernels"), ("neuronfx.graphs.kernels", "neuronfx.graphs.phases")}
"""Pairs of packages of one rank that must not import each other."""


def module_name(path: Path) -> str:
    parts = ["neuronfx", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts}


def imports(path: Path, known: set[str]) -> set[str]:
    """neuronfx modules ``path`` imports anywhere in its body (``from pkg import mod`` resolves
    to the module when ``mod`` is one). The family registry's by-name import
    (``graphs/models/__init__.py``: ``neuronfx.graphs.models.<file>``) counts as an import of every
    family file."""
    out = set()
    if module_name(path) == "neuronfx.graphs.models":
        from neuronfx.config.families import SUPPORTED_MODEL_TYPES, math_file

        out |= {f"neuronfx.graphs.models.{math_file(t)}" for t in SUPPORTED_MODEL_TYPES}
    for node in ast.walk(ast.parse(path.read_text())):
        assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}: relative import; write neuronfx.… in full"
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "neuronfx"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "neuronfx":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def rank(module: str) -> int:
    """The rank of the most specific prefix of ``module`` in RANKS."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in RANKS:
            return RANKS[".".join(parts[:i])]
    raise AssertionError(f"{module} has no layer in RANKS; add it")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_lazy_imports_included():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_has_a_layer():
    for name in modules():
        rank(name)


def test_graph_math_never_asks_whether_it_is_compiled():
    """The model math (family files, shared layers, phases) reads no compiler or tracing state."""
    for path in [*(ROOT / "graphs" / "models").glob("*.py"), *(ROOT / "graphs" / "phases").glob("*.py")]:
        text = path.read_text()
        for needle in ("is_compiling", "inductor_tracing", "is_exporting", "is_tracing", "is_scripting", "torch.compiler",
                       "torch._dynamo", "torch.jit", "small_gemm"):
            assert needle not in text, f"{path.relative_to(ROOT)} mentions {needle}"


def test_io_modules_know_no_backend():
    """Saving, loading and caching go through the backend records (graphs/backends/): no
    branch on a backend's name, no probe of a backend's graph types."""
    for name in ("io/artifacts.py", "io/cache.py", "api.py"):
        text = (ROOT / name).read_text()
        for needle in ("backend ==", "GraphModule", "PrecompiledPart", "ExportedGraph", "parts.prologue", "backends.inductor",
                       '"inductor"', '"export"', '"eager"'):
            assert needle not in text, f"{name} mentions {needle}"


def test_backend_names_agree():
    from neuronfx.config.inference import BACKENDS as NAMES
    from neuronfx.graphs.backends import BACKENDS

    assert tuple(BACKENDS) == NAMES


def test_family_registry_names_its_files():
    """Every registered model type has its flat file (its own, or the one the remap table names)
    ending with the FamilyMath record the graphs use; an alias has no file of its own."""
    import importlib

    from neuronfx.config.families import MODEL_REMAPPING, SUPPORTED_MODEL_TYPES
    from neuronfx.graphs.models import family_math
    from neuronfx.graphs.models.family import FamilyMath

    assert set(MODEL_REMAPPING) <= set(SUPPORTED_MODEL_TYPES) and not set(MODEL_REMAPPING.values()) & set(MODEL_REMAPPING)
    for model_type in SUPPORTED_MODEL_TYPES:
        module = importlib.import_module(f"neuronfx.graphs.models.{MODEL_REMAPPING.get(model_type, model_type)}")
        assert isinstance(module.MATH, FamilyMath) and family_math(model_type) is module.MATH
        assert callable(module.MATH.key_map) and callable(module.MATH.layer_shapes) and callable(module.MATH.decoder_layer)
    assert not any((ROOT / "graphs" / "models" / f"{t}.py").exists() for t in MODEL_REMAPPING)


def upward_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported) pairs that import a higher rank or a forbidden sibling."""
    def package(m: str, prefix: str) -> bool:
        return m == prefix or m.startswith(prefix + ".")

    return [(m, dep) for m, deps in edges.items() for dep in deps
            if rank(dep) > rank(m) or any(package(m, a) and package(dep, b) for a, b in FORBIDDEN)]


def test_upward_imports_are_found():
    """A planted upward import (config -> runtime) and a phases -> kernels import both fail."""
    assert upward_imports({"neuronfx.config.plan": {"neuronfx.runtime.steps"}}) == [("neuronfx.config.plan", "neuronfx.runtime.steps")]
    assert upward_imports({"neuronfx.graphs.phases.prefill": {"neuronfx.graphs.kernels.library"}})
    assert not upward_imports({"neuronfx.graphs.backends.eager": {"neuronfx.graphs.kernels.library", "neuronfx.config.plan"}})


def test_layers_import_downwards_only_and_siblings_stay_apart():
    assert not upward_imports(graph()), f"upward imports (module -> imported): {upward_imports(graph())}"


def private_uses(source: str) -> list[str]:
    """``from neuronfx.x import _name`` and ``<neuronfx module>._name`` (attribute, or
    ``setattr(module, "_name", ...)`` as monkeypatch writes it) in ``source``: reaching into
    another module's private names. Dunder names (``__version__``) are public by convention."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    tree, found, modules_ = ast.parse(source), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "neuronfx":
            found += [f"from {node.module} import {a.name}" for a in node.names if private(a.name)]
            modules_ |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules_ |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "neuronfx"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and ast.unparse(node.value).split(".")[0] in modules_:
            found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("setattr") and len(node.args) >= 2
              and ast.unparse(node.args[0]).split(".")[0] in modules_ and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and private(node.args[1].value)):
            found.append(f"{ast.unparse(node.args[0])}.{node.args[1].value}")
    return found


NAMED_TUPLE_API = {"_fields", "_replace", "_asdict", "_make"}


def test_private_uses_are_found():
    planted = ("from neuronfx.runtime.state import _Lease\nfrom neuronfx.runtime import steps\n"
               "steps._follow_draft(1)\nmonkeypatch.setattr(steps, '_one_token_each', None)\nfrom neuronfx.version import __version__\n")
    assert sorted(private_uses(planted)) == ["from neuronfx.runtime.state import _Lease", "steps._follow_draft", "steps._one_token_each"]


def test_no_module_or_test_uses_another_modules_private_names():
    tests = Path(__file__).parent
    found = {str(p): uses for p in [*ROOT.rglob("*.py"), *tests.rglob("*.py")] if p != Path(__file__)
             and (uses := [u for u in private_uses(p.read_text()) if u.rsplit(".", 1)[-1] not in NAMED_TUPLE_API])}
    assert not found, f"private names used across modules (make them public or move the caller): {found}"
