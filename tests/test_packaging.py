"""The wheel holds every package of the source tree: a package missing from pyproject.toml's
list works from a checkout (and `pip install -e`) and fails after `pip install .`."""

from __future__ import annotations

import tomllib

from tests.conftest import REPO


def test_every_package_of_the_tree_is_listed_in_pyproject():
    """Each kvtierd/ folder with an __init__.py (connectors/ through its symlink) is in [tool.setuptools] packages."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "kvtierd").rglob("__init__.py")}
    # kvtierd/connectors is a symlink to connectors/, which rglob does not follow
    found |= {".".join(("kvtierd", *init.parent.relative_to(REPO).parts))
              for init in (REPO / "connectors").rglob("__init__.py")}
    found |= {"kvtierd._kernels"}  # kernels/*.cu, mapped by package-dir
    assert found - listed == set(), "packages missing from pyproject.toml"
    assert listed - found == set(), "pyproject.toml lists packages the tree does not have"
