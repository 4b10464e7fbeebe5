"""Nothing in the checkout shadows an installed package.

Python started from the repository root (``python -m pytest``, ``python -m bench.X``, a user's
script) has the root first on ``sys.path``, so a top-level folder with an ``__init__.py`` (or a
top-level ``.py`` file) is imported instead of an installed distribution of the same name. The
Triton kernels' folder ``kernels/`` was one (transformers 5 imports Hugging Face's ``kernels``
while loading a model: ``cannot import name 'CUDAProperties' from 'kernels'``); it and
``server/`` now ship as ``radixkv.kernels`` and ``radixkv.server`` only (see
``radixkv/package_folders.py``).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def top_level_importables() -> dict[str, Path]:
    """What ``import NAME`` finds in the repository root: packages and modules (namespace
    folders without ``__init__.py`` lose to any installed package, so they shadow nothing)."""
    found: dict[str, Path] = {}
    for entry in ROOT.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and any((entry / f"__init__{s}").exists() for s in (".py", ".pyc")):
            found[entry.name] = entry
        elif entry.is_file() and entry.suffix == ".py":
            found[entry.stem] = entry
    return found


def run_from_root(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_hugging_face_kernels_imports_as_installed_from_the_root():
    # transformers >= 5 requires the `kernels` distribution; the lock installs it
    dist = importlib.metadata.distribution("kernels")
    proc = run_from_root(
        "import kernels, sys; from kernels import CUDAProperties, get_kernel; "
        "print(kernels.__file__)"
    )
    assert proc.returncode == 0, proc.stderr
    where = Path(proc.stdout.strip()).resolve()
    assert where.is_relative_to(Path(dist.locate_file("")).resolve()), where
    assert not where.is_relative_to(ROOT / "kernels")


def test_no_top_level_folder_shadows_an_installed_distribution():
    installed = importlib.metadata.packages_distributions()
    shadowing = {
        name: installed[name]
        for name in top_level_importables()
        if name in installed and set(installed[name]) != {"radixkv"}
    }
    assert not shadowing, f"checkout folders that shadow installed packages: {shadowing}"
    # and the two folders that were regular packages are not any more
    for folder in ("kernels", "server"):
        assert folder not in top_level_importables(), f"{folder}/ has an __init__.py again"


def test_radixkv_kernels_and_server_import_from_the_root_and_elsewhere(tmp_path):
    code = (
        "import radixkv.kernels as k, radixkv.server as s, radixkv.server.protocol, "
        "radixkv.kernels.reference as r; assert k.store_kvcache_ref is r.store_kvcache_ref; "
        "assert callable(s.create_app); print(k.__path__[0], s.__path__[0])"
    )
    for cwd in (ROOT, tmp_path):
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [str(ROOT / "kernels"), str(ROOT / "server")]


@pytest.mark.slow
def test_a_built_wheel_ships_both_subpackages(tmp_path):
    """A wheel (what a non-editable install gets) holds radixkv/kernels.py beside the folder of
    its modules, and the installed copy imports from a folder that is not the checkout."""
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("radixkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in (
        "radixkv/kernels.py",
        "radixkv/kernels/decode_attention.py",
        "radixkv/server.py",
        "radixkv/server/app.py",
        "radixkv/server/static/dashboard.html",
    ):
        assert need in names, need
    assert "kernels/__init__.py" not in names and "server/__init__.py" not in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r}); "
            "import radixkv.kernels as k, radixkv.server.dashboard as d; "
            "print(k.__path__[0]); print(d.STATIC_DIR.exists())",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    path, static = proc.stdout.split()
    assert path == str(site / "radixkv" / "kernels") and static == "True"
