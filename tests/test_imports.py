"""The import graph of the package: every import goes to the same floor or one below it
(docs/design.md, Layout), and no modules import each other in a circle. Imports inside
functions count too: a lazy import is still an arrow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cellcache"

# floors, lowest first (docs/design.md's Layout table)
FLOORS = [
    {"errors", "_checks", "config", "buffers", "buckets", "_cli", "_bitset"},
    {"reference", "_table", "_views"},
    {"cache", "pools", "host", "cuda", "cuda.probe", "cuda.driver", "cuda.pools", "cuda.backend",
     "cuda.kernels", "cuda.tc", "cuda.fused", "cuda._launch", "cuda._dlpack", "cuda._engine"},
    {"registry"},
    {"radix", "prefix_events", "prefix_policy", "prefix_tree"},
    {"attention", "session", "prefix", "torch", "cascade", "batch_invariant", "hf", "runner", "tp",
     "native",
     "tp.shard", "tp.peers", "tp.agreement", "seqstate"},
    # the generator package: each module only above those it imports
    {"generate.text", "generate.sleep", "generate.spill"},
    {"generate.requests", "generate.readback"},
    {"generate.plan", "generate.prompts"},
    {"generate.sampler", "generate.logprobs"},
    {"generate.kv"},
    {"generate.base"},
    {"generate.scheduler"},
    {"generate.distributed", "generate.options"},
    {"generate.engine", "generate.drivers", "generate.agreement", "generate.state"},
    {"generate.cli"},
    {"generate"},
    # the HTTP server (issue 40): each module only above those it imports
    {"serve.protocol", "serve.metrics"},
    {"serve.engine"},
    {"serve.process", "serve.app"},
    {"serve.cli"},
    {"serve"},
    {"demo", "__main__"},
    {"__init__"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def sources() -> dict[str, Path]:
    """Every module of the package: its Python files and the Cython sources in pyx/."""
    out = {module_name(p): p for p in PKG.rglob("*.py")}
    for p in (ROOT / "pyx").rglob("*.pyx"):
        out[".".join(p.relative_to(ROOT / "pyx").with_suffix("").parts)] = p
    for p in PKG.rglob("*.pxd"):
        out.setdefault(module_name(p), p)
    return out


def resolve(module: str, level: int, target: str | None) -> str:
    """The package-relative name an import in ``module`` names."""
    if level:
        package = [] if module == "__init__" else module.split(".")
        if sources()[module].name != "__init__.py":
            package = package[:-1]
        base = package[:len(package) - (level - 1)]
    else:
        base = []
        if not target or not (target == "cellcache" or target.startswith("cellcache.")):
            return ""
        target = target.removeprefix("cellcache").lstrip(".")
    return ".".join(base + ([target] if target else []))


def imports(module: str, path: Path) -> set[str]:
    """Package modules ``module`` imports (names that are not modules are dropped)."""
    known = sources()
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    if path.suffix == ".py":
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = resolve(module, node.level, node.module)
                if not base and not node.level:
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    add(full if full in known else base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    add(resolve(module, 0, alias.name))
    else:                                   # Cython: from .x / cellcache.x (c)import
        for m in re.finditer(r"^\s*from\s+(\.*)([\w.]*)\s+c?import", path.read_text(), re.M):
            add(resolve(module, len(m.group(1)), m.group(2) or None))
    return found


def graph() -> dict[str, set[str]]:
    return {m: imports(m, p) for m, p in sources().items()}


def test_every_module_has_a_floor():
    assert sorted(set(sources()) - set(FLOOR)) == []


def test_no_import_goes_up():
    up = [(m, t) for m, targets in graph().items() for t in targets if FLOOR[t] > FLOOR[m]]
    assert up == []


def test_no_circle():
    g = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_check_sees_arrows():
    g = graph()
    assert "cache" in g["host"] and "_table" in g["cache"] and "hf" in g["generate.engine"]
    assert "_table" in g["_views"] and "cuda._launch" in g["cuda._engine"]
    assert {"cache", "registry", "prefix"} <= g["__init__"] and "cuda.probe" in g["cuda"]
    assert {"generate.scheduler", "generate.sampler"} <= g["generate.engine"]
    assert "generate.engine" in g["generate"] and "cache" in g["generate.scheduler"]


def _third_party(path: Path) -> set[str]:
    """Top-level names of the non-package modules ``path`` imports (lazy imports included)."""
    names: set[str] = set()
    if path.suffix != ".py":
        return names
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_scheduler_and_its_plan_need_no_torch():
    """The scheduler, its step plan and its door to memory are host code: nothing they
    import, directly or through the package, imports torch (the runner and the sampler do)."""
    known, arrows = sources(), graph()
    for root in ("generate.plan", "generate.kv", "generate.base", "generate.scheduler"):
        seen, todo = set(), [root]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(arrows[m])
        torch_users = sorted(m for m in seen if "torch" in _third_party(known[m]))
        assert torch_users == [], (root, torch_users)
