"""Where the ``radixkv.kernels`` and ``radixkv.server`` subpackages' modules live.

Their sources sit in the top-level ``kernels/`` and ``server/`` folders of the checkout, which
have no ``__init__.py``: a folder with one is a regular package named ``kernels`` (or ``server``)
for any Python started from the repository root, and would shadow an installed distribution of
that name (Hugging Face's ``kernels``, which transformers imports while loading a model). Each
subpackage is therefore a module, ``radixkv/kernels.py`` and ``radixkv/server.py``, that sets its
own ``__path__`` to the folder holding its modules:

- in a wheel, setuptools' ``package-dir`` ships the folder as ``radixkv/kernels/`` beside the
  module (a module file wins over a folder without ``__init__.py`` of the same name);
- in a checkout (editable install, or the repository root on ``sys.path``) it is the top-level
  folder.
"""

from __future__ import annotations

from pathlib import Path


def package_path(module_file: str, folder: str) -> list[str]:
    """The ``__path__`` of the subpackage whose module is ``module_file``: its modules' folder,
    shipped (``radixkv/<folder>/``) or in the checkout (``<root>/<folder>/``)."""
    here = Path(module_file).resolve()
    for candidate in (here.with_suffix(""), here.parents[1] / folder):
        if candidate.is_dir():
            return [str(candidate)]
    raise ImportError(
        f"radixkv.{folder}: its modules' folder is neither {here.with_suffix('')} "
        f"nor {here.parents[1] / folder}"
    )
