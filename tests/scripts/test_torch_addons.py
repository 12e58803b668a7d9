"""scripts/torch_addons.py: an add-on that fails to import beside this torch is named with its error
(exit 1), --uninstall removes it (exit 0 after), and one that imports is left alone."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "scripts" / "torch_addons.py")


def install_fake(site: Path, name: str, body: str) -> None:
    """A package `name` 0.0.1 with an __init__ of `body` and the dist-info pip needs to uninstall it."""
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(body)
    info = site / f"{name}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    (info / "INSTALLER").write_text("pip\n")
    records = [f"{name}/__init__.py,,", f"{info.name}/METADATA,,", f"{info.name}/INSTALLER,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(records) + "\n")


def test_a_broken_addon_is_named_then_uninstalled_and_a_working_one_stays(tmp_path):
    venv = tmp_path / "venv"
    # The system's packages (torch) stay visible; the fakes go in the venv, where its pip may remove them.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert site != Path(sysconfig.get_paths()["purelib"])
    install_fake(site, "torchcodec", 'raise RuntimeError("operator torchcodec::decode does not exist")\n')
    install_fake(site, "torchaudio", "")

    check = subprocess.run([python, SCRIPT], capture_output=True, text=True)
    assert check.returncode == 1, check.stderr
    assert "torchcodec 0.0.1 does not import beside torch" in check.stderr
    assert "RuntimeError: operator torchcodec::decode does not exist" in check.stderr
    assert "torchaudio" not in check.stderr
    assert "pip uninstall -y torchcodec (or use a fresh venv)" in check.stderr

    fixed = subprocess.run([python, SCRIPT, "--uninstall"], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr
    assert not (site / "torchcodec").exists()
    assert (site / "torchaudio" / "__init__.py").exists()
    assert subprocess.run([python, SCRIPT], capture_output=True, text=True).returncode == 0


def test_a_stray_argument_is_refused_with_the_usage():
    done = subprocess.run([sys.executable, SCRIPT, "--fix"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "usage:" in done.stderr and "[--uninstall]" in done.stderr
