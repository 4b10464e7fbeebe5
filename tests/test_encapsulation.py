"""Module seams, enforced (issue 60): no module reads another module's private names, and no
engine is typed ``Any``.

An AST scan of every module tests/test_layering.py scans (``radixkv/``, ``server/``,
``kernels/``).

**Private names.** A name with one leading underscore (``_x``; ``__x`` too, not a dunder
``__x__``) is private to the *module* that defines it, Python's own convention. A module's own
private names are those it binds: at module level, in a class body, as a function or class
name at any depth, as an attribute of ``self`` / ``cls`` (assigned, or set through
``setattr(self, "_x", ...)`` / ``object.__setattr__(self, "_x", ...)``). So:

* ``self._x`` / ``cls._x`` / ``super()._x`` must name one of this module's own private names:
  a private attribute set by a base class or mixin in another module is that module's state (the
  host class and the mixin then share private state across a module seam);
* ``other._x`` on any other object is allowed only where ``_x`` is one of this module's own
  private names: an instance of a class defined in the same module (``__eq__`` reading
  ``other._x``, a classmethod finishing the instance it made) stays inside the module that owns
  the name, which is the boundary the convention draws. The check is by name, so an object of
  another module whose private attribute happens to share a name with one of ours escapes it;
* ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr`` with a constant private name count as
  the attribute access they spell;
* ``from <radixkv module> import _x`` (absolute or relative) is always a violation;
* third-party libraries: an access whose base is rooted at a name imported from a third-party
  package (``torch._C._cpu``, ``torch.ops.mkldnn._reorder_linear_weight``, ``sys._getframe``)
  is allowed, as their internals are theirs to name; an instance of a third-party class reached
  through our own objects (``self._leaves._check()`` on a ``SortedList``) is not.

**The engine's type.** No parameter, attribute or property named ``engine`` (or ``*_engine``,
``engines``) is annotated with ``Any`` anywhere in the scan: the server is written
against :class:`radixkv.engine.api.EngineAPI`, the engine's parts against narrow protocols of
what they read.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from test_layering import modules

#: packages whose names are ours (absolute imports of anything else are third-party)
OURS = {"radixkv", "kernels", "server", "tests", "bench"}
ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}
ENGINE = re.compile(r"(^|_)engines?$")


def is_private(name: str) -> bool:
    """``_x`` and ``__x``, not ``_`` and not a dunder ``__x__``."""
    return (
        name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))
    )


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _root(node: ast.expr) -> ast.expr:
    """The leftmost expression of an attribute / call / subscript chain."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _ours(module: str | None) -> bool:
    """Whether an absolute import of ``module`` is of one of our packages."""
    return (module or "").split(".")[0] in OURS


def _const_name(call: ast.Call, index: int) -> str | None:
    if len(call.args) > index and isinstance(arg := call.args[index], ast.Constant):
        return arg.value if isinstance(arg.value, str) else None
    return None


class _OwnNames(ast.NodeVisitor):
    """The names a module binds itself (see the module docstring)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.in_function = 0

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.names.add(node.name)
        self.in_function += 1
        self.generic_visit(node)
        self.in_function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.names.add(node.name)
        outer, self.in_function = self.in_function, 0  # a class body binds its attributes
        self.generic_visit(node)
        self.in_function = outer

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store) and not self.in_function:
            self.names.add(node.id)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        """``x += 1`` reads ``x`` first: it binds nothing new."""
        target = node.target
        self.visit(target.value if isinstance(target, ast.Attribute) else node.value)
        self.visit(node.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store) and _is_self(node.value):
            self.names.add(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        is_setattr = isinstance(f, ast.Name) and f.id == "setattr"
        is_dunder = isinstance(f, ast.Attribute) and f.attr == "__setattr__"
        on_self = (is_setattr or is_dunder) and node.args and _is_self(node.args[0])
        if on_self and (name := _const_name(node, 1)) is not None:
            self.names.add(name)
        self.generic_visit(node)


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names bound by importing a third-party module or one of its names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top not in OURS:
                    names.add(alias.asname or top)
        elif isinstance(node, ast.ImportFrom) and not node.level and not _ours(node.module):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def private_accesses(source: str, module: str) -> list[str]:
    """``module:line: expression`` for every access to another module's private name."""
    tree = ast.parse(source)
    owner = _OwnNames()
    owner.visit(tree)
    own, foreign = owner.names, _foreign_names(tree)
    found: list[str] = []

    def check(node: ast.AST, base: ast.expr, name: str) -> None:
        if not is_private(name) or name in own:
            return
        root = _root(base)
        if not _is_self(base) and isinstance(root, ast.Name) and root.id in foreign:
            return
        found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            check(node, node.value, node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ATTR_FUNCS and node.args and (name := _const_name(node, 1)):
                check(node, node.args[0], name)
        elif isinstance(node, ast.ImportFrom) and (node.level or _ours(node.module)):
            private = [alias.name for alias in node.names if is_private(alias.name)]
            if private:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def _mentions_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _mentions_any(ast.parse(annotation.value, mode="eval").body)
    return any(
        (isinstance(n, ast.Name) and n.id == "Any")
        or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(annotation)
    )


def _annotated(tree: ast.Module) -> Iterator[tuple[ast.AST, str, ast.expr | None]]:
    """(node, name, annotation) of every parameter, annotated assignment and function return."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    yield arg, arg.arg, arg.annotation
            yield node, node.name, node.returns  # a property ``engine`` returning Any
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            yield node, name, node.annotation


def any_typed_engines(source: str, module: str) -> list[str]:
    """``module:line: name`` for every engine annotated with ``Any``."""
    return [
        f"{module}:{node.lineno}: {name}"  # type: ignore[attr-defined]
        for node, name, annotation in _annotated(ast.parse(source))
        if ENGINE.search(name) and _mentions_any(annotation)
    ]


def scan(check: Callable[[str, str], list[str]]) -> str:
    """``check(source, module)``'s findings over every scanned module, one a line."""
    return "\n".join(
        hit for name, path in sorted(modules().items()) for hit in check(path.read_text(), name)
    )


def test_no_module_reads_another_modules_private_names() -> None:
    found = scan(private_accesses)
    assert not found, f"private names used across modules (give them a public name):\n{found}"


def test_no_engine_is_typed_any() -> None:
    found = scan(any_typed_engines)
    assert not found, f"engines typed Any (use EngineAPI, Engine or a protocol):\n{found}"


PLANTED = """
import torch
import sys as system
from sortedcontainers import SortedList
from radixkv.cache import tiers
from radixkv.cache.tiers import _private_helper
from .sibling import _other, public

_TABLE = {}


class Pool:
    _shared = 0

    def __init__(self, store):
        self._pages = []
        setattr(self, "_dynamic", 1)
        self._leaves = SortedList()
        self.store = store

    def good(self, other: "Pool"):
        _TABLE.clear()
        torch._C._cpu._init_amx()
        getattr(torch.ops.mkldnn, "_reorder")
        system._getframe()
        SortedList._reset
        return other._pages + [self._dynamic, Pool._shared, self.__class__]

    def bad(self):
        self.store._queue.clear()
        self._leaves._check()
        self._inherited_state += 1
        super()._base_helper()
        getattr(self.store, "_lock")
        tiers._helper()
        return self.store.pool._pages_of_someone_else
"""


def test_the_private_name_check_fires_on_planted_violations() -> None:
    found = private_accesses(PLANTED, "m")
    flagged = {hit.partition(": ")[2] for hit in found}
    assert flagged == {
        "from radixkv.cache.tiers import _private_helper",
        "from .sibling import _other, public",
        "self.store._queue",
        "self._leaves._check",
        "self._inherited_state",
        "super()._base_helper",
        "getattr(self.store, '_lock')",
        "tiers._helper",
        "self.store.pool._pages_of_someone_else",
    }, found
    assert all(hit.startswith("m:") for hit in found)


def test_the_engine_type_check_fires_on_planted_violations() -> None:
    source = """
from typing import Any
import typing

def a(engine: Any, n: int) -> None: ...
def b(*, child_engine: "Any | None" = None) -> None: ...
def c(engines: list[typing.Any]) -> None: ...
def d(engine: "EngineAPI", engine_kwargs: dict[str, Any], engineer: Any) -> Any: ...
class Host:
    engine: Any
    def __init__(self, engine: object) -> None:
        self.engine: dict[str, Any] = {}
    @property
    def child_engine(self) -> Any: ...
"""
    found = {hit.partition(": ")[2] for hit in any_typed_engines(source, "m")}
    assert found == {"engine", "child_engine", "engines"}, found
    lines = sorted(int(hit.split(":")[1]) for hit in any_typed_engines(source, "m"))
    assert lines == [5, 6, 7, 10, 12, 14], lines
