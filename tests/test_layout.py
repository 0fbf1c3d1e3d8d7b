"""No object reaches into another's private state.

Every module under ``cellcache/`` and ``tools/`` is parsed, and each access to a private
attribute (``x._name``, not a dunder; ``getattr``/``setattr``/``hasattr``/``delattr`` with a
literal ``"_name"`` too) must be one of:

- on ``self``, ``cls``, ``super()`` or ``type(self)``: the object's own state, wherever in its
  class hierarchy the name is defined (a backend in ``host.py`` using the base class's
  ``self._table``);
- on a class the same module defines (``Generator._sample``): the class's own attribute;
- listed in ``ALLOWED`` below with the reason: private names of third-party objects that
  offer no public way to do what is needed.

Anything else fails, naming the file, line and expression, also between two objects of one
module (a helper reading its owner's ``_lock``, a function reading ``view._flashinfer``, a
backend's buffer reading ``self._cache._ctx``): ask through a public method or property
instead (``cache.on_close``, ``cache.table``, ``view.plan(...)``, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("cellcache", "tools")

#: (file, attribute) -> why it is allowed
ALLOWED = {
    ("cellcache/hf.py", "_attn_implementation_internal"):
        "transformers keeps a config's attention setting there; attach restores it exactly "
        "(None included) after a refused probe, which no public setter does",
    ("cellcache/hf.py", "_attn_implementation"):
        "transformers' only reader of the attention a config resolved to",
    ("cellcache/tp/peers.py", "_device_types"):
        "torch's only list of the devices a process group has backends for: where the group's "
        "timeout is read (agreement waits are bounded by it)",
    ("cellcache/tp/peers.py", "_get_backend"):
        "torch's only way to a process group's backend options, which hold the timeout it was "
        "made with; no public getter exists",
    ("cellcache/tp/peers.py", "_timeout"):
        "the timeout a process group's backend options were made with (read through "
        "_get_backend): torch keeps it only there",
    ("cellcache/tp/peers.py", "_get_default_store"):
        "the store of the default group, the rendezvous every rank already shares: the survivors "
        "of a lost rank report there to name it (torch has no public accessor)",
    ("cellcache/serve/process.py", "_exit"):
        "os._exit, the standard library's documented way to end a process at once: an engine "
        "process that can no longer write to its front end must not linger stepping for nobody",
    ("tools/bench_gpu.py", "_sleep"):
        "torch.cuda._sleep: torch's spin kernel, the way to hold a stream busy in a benchmark",
}

_ATTR_FUNCS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _classes(tree: ast.Module) -> set[str]:
    """Names of the classes the module defines (at any depth)."""
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _own(target: ast.expr, classes: set[str]) -> bool:
    """Whether ``target`` is the object itself, its class or a class of this module."""
    if isinstance(target, ast.Name):
        return target.id in ("self", "cls") or target.id in classes
    return (isinstance(target, ast.Call) and isinstance(target.func, ast.Name)
            and (target.func.id == "super"
                 or (target.func.id == "type" and len(target.args) == 1
                     and isinstance(target.args[0], ast.Name) and target.args[0].id == "self")))


def reach_ins(source: str, rel: str) -> list[str]:
    """``rel:line: expression`` for every private access in ``source`` (the file ``rel``)
    that the rules above do not allow."""
    tree = ast.parse(source, filename=rel)
    classes = _classes(tree)
    found = []

    def check(node: ast.AST, target: ast.expr, name: str) -> None:
        if not _private(name) or _own(target, classes) or (rel, name) in ALLOWED:
            return
        found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            check(node, node.value, node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTR_FUNCS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            check(node, node.args[0], node.args[1].value)
    return found


def modules() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))


def test_no_object_reaches_into_another_objects_private_state():
    found = [line for p in modules()
             for line in reach_ins(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not found, "private attributes of other objects:\n" + "\n".join(found)


SAMPLE = """
class Buffer:
    __slots__ = ("_slot",)

    def __init__(self, cache):
        self._cache = cache
        self._own = 1
        super()._setup()                               # its own hierarchy: fine

    def ptr(self):
        return self._own + type(self)._slot + Buffer._slot   # its own state and class: fine

    def peek(self):
        return self._cache._ctx                        # its owner's state, even in this module

def tool(cache, torch, buf):
    cache._undo.callback(print)                       # another object's state
    torch.cuda._sleep(10)                             # allowed only in tools/bench_gpu.py
    buf._own += 1                                     # a name this module defines, on another object
    return getattr(cache, "_table", None), cache.__class__
"""


def test_the_check_flags_reach_ins_and_nothing_else():
    found = reach_ins(SAMPLE, "tools/sample.py")
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        "buf._own", "cache._undo", "getattr(cache, '_table', None)", "self._cache._ctx",
        "torch.cuda._sleep"]
    assert [line for line in reach_ins(SAMPLE, "tools/bench_gpu.py") if "_sleep" in line] == []


def test_every_allowed_entry_is_still_needed():
    """An allow-list entry whose access went away is dropped, not kept for the future."""
    used = set()
    for p in modules():
        rel = p.relative_to(ROOT).as_posix()
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (rel, node.attr) in ALLOWED:
                used.add((rel, node.attr))
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and (rel, node.value) in ALLOWED):
                used.add((rel, node.value))
    assert used == set(ALLOWED)


def test_the_cython_mark_names_test_modules_that_exist():
    """tests/conftest.py's list of modules the bounds-checked pass runs: a renamed or removed
    module would silently leave that pass."""
    from .conftest import CYTHON

    have = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    assert CYTHON <= have, sorted(CYTHON - have)
