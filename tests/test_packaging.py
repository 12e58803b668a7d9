"""The wheel holds every package of the source tree: a package missing from pyproject.toml's
list works from a checkout (and `pip install -e`) and fails after `pip install .`. A checkout
imports by the paths an install does (connectors/ as kvtierd.connectors)."""

from __future__ import annotations

import subprocess
import sys
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


def test_the_source_tree_imports_the_connectors_as_installed():
    """No site-packages at all (-S): kvtierd.connectors comes from the checkout's connectors/."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import kvtierd.connectors.demo.model_fetch as m; "
            f"print(m.__file__)")
    done = subprocess.run([sys.executable, "-S", "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(REPO / "kvtierd" / "connectors" / "demo" / "model_fetch.py")
