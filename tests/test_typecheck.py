"""mypy over the engine's interface and its users: radixkv/engine/api.py (``EngineAPI``), the
server (``server/``, shipped as ``radixkv.server``) and the tests' stand-in engine
(tests/fake_engine.py), and the modules at the engine's and the tiers' seams (``CHECKED``). A
type error there fails the suite (issue 60): the server and the fake engine are written against
``EngineAPI``, and ``radixkv.Engine`` is checked against it where ``radixkv serve`` hands one to
``create_app``, and against the protocols its parts take it as.

mypy's settings are ``[tool.mypy]`` in pyproject.toml. ``server/`` has no ``__init__.py`` and
is mapped in as ``radixkv.server`` at run time (:mod:`radixkv.package_folders`), which mypy
cannot follow, so the check runs on a tree of links laid out as the installed package is:
``radixkv/`` with ``server/`` as ``radixkv/server/`` (``radixkv/server.py`` as its
``__init__.py``), likewise ``kernels/``, and ``fake_engine.py`` (with the ``server_thread.py``
it re-exports) beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: checked and reported; every other module they import is read for its types only. Beyond the
#: server's side: the engine, checked against the protocols its parts take it as (pinning,
#: lifetime, integrity report), and the tiers' parts sharing one ``TierStores``
CHECKED = (
    "radixkv/engine/api.py",
    "radixkv/server",
    "fake_engine.py",
    "radixkv/engine/engine.py",
    "radixkv/engine/pinning.py",
    "radixkv/engine/lifetime.py",
    "radixkv/engine/integrity_report.py",
    "radixkv/engine/tokenizer_lock.py",
    "radixkv/model/prefault.py",
    "radixkv/cache/tiers.py",
    "radixkv/cache/tier_stores.py",
    "radixkv/cache/tier_loads.py",
    "radixkv/cache/tier_writes.py",
    "radixkv/cache/tier_durability.py",
    "radixkv/cache/remote_store.py",
    "radixkv/cache/remote_health.py",
    "radixkv/cache/eviction.py",
    "radixkv/cache/residency.py",
)


def link_tree(dest: Path) -> None:
    """Lay out ``dest`` as the installed package: links to every file, folders mapped."""
    pkg = dest / "radixkv"
    pkg.mkdir()
    for entry in (ROOT / "radixkv").iterdir():
        if entry.name in ("server.py", "kernels.py", "__pycache__"):
            continue
        (pkg / entry.name).symlink_to(entry)
    for sub in ("server", "kernels"):
        (pkg / sub).mkdir()
        (pkg / sub / "__init__.py").symlink_to(ROOT / "radixkv" / f"{sub}.py")
        for module in (ROOT / sub).glob("*.py"):
            (pkg / sub / module.name).symlink_to(module)
    for name in ("fake_engine.py", "server_thread.py"):
        (dest / name).symlink_to(ROOT / "tests" / name)


@pytest.mark.slow
def test_engine_api_and_its_users_type_check(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy comes with radixkv's test extras (pip -e .[test])")
    tree = tmp_path / "tree"
    tree.mkdir()
    link_tree(tree)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            *CHECKED,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mypy found type errors:\n{out}"
    assert "Success" in out, out
