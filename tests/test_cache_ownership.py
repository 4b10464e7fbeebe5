"""Who owns the cache's state (docs/design.md, "Where do I change eviction / a tier").

Every part of the tree and of the tiers owns its state and is reached through its methods and
read-only views, so no module of ``radixkv/cache/`` reads or writes another module's private
names: an AST scan finds ``obj._x`` (or ``getattr(obj, "_x")``) where ``obj`` is not
``self``/``cls`` and ``_x`` is defined in another module of the package and not in this one.
The device pool is reached through :class:`~radixkv.cache.page_pool.PagePool`, which the model's
``KVPool`` implements structurally.
"""

from __future__ import annotations

import ast
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / "radixkv" / "cache"


def _defined(tree: ast.AST) -> set[str]:
    """Names a module defines: defs, classes, ``self._x`` / ``cls._x`` assignments, assigned
    module or class names, imports, arguments (annotations alone do not define)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                out.add(n.attr)
        elif isinstance(n, ast.Assign | ast.For | ast.comprehension):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out.update(x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name))
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            if isinstance(n.target, ast.Name):
                out.add(n.target.id)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def _private_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``(line, attribute, source)`` of every ``obj._x`` / ``getattr(obj, "_x")`` with ``obj``
    not ``self`` / ``cls``."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            attr, obj = n.attr, n.value
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "setattr", "hasattr")
            and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
        ):
            attr, obj = n.args[1].value, n.args[0]
        else:
            continue
        if not attr.startswith("_") or attr.startswith("__"):
            continue
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            continue
        out.append((n.lineno, attr, ast.unparse(n)))
    return out


def cross_module_private_access(folder: Path) -> list[str]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(folder.rglob("*.py"))}
    defined = {p: _defined(t) for p, t in trees.items()}
    bad = []
    for path, tree in trees.items():
        others = set().union(*(d for q, d in defined.items() if q != path))
        for line, attr, src in _private_uses(tree):
            if attr in others and attr not in defined[path]:
                bad.append(f"{path.name}:{line}: {src}")
    return bad


def test_no_cross_module_private_access_in_the_cache() -> None:
    bad = cross_module_private_access(CACHE)
    assert not bad, "private state of another cache module:\n" + "\n".join(bad)


def test_the_scan_can_fail(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class A:\n    def __init__(self):\n        self._n = 0\n")
    (tmp_path / "b.py").write_text(
        "def f(a, b):\n    a._n += 1\n    return getattr(b, '_n'), a.__dict__, a._own\n_own = 1\n"
    )
    assert cross_module_private_access(tmp_path) == [
        "b.py:2: a._n",
        "b.py:3: getattr(b, '_n')",
    ]


def test_the_model_kv_pool_is_a_page_pool() -> None:
    import torch

    from radixkv.cache.host_pool import HostPool
    from radixkv.cache.page_pool import PagePool
    from radixkv.model.kv_pool import KVPool

    pool = KVPool(2, 4, 2, 1, 8, torch.float32)
    assert isinstance(pool, PagePool)
    host = HostPool.like(pool, 3)
    pool.k[1][2].fill_(3.0)
    host.save(pool, [2], [0])
    host.load(pool, [0], [3])
    assert torch.equal(pool.k[1][3], pool.k[1][2]) and pool.bytes_per_page == host.bytes_per_page
