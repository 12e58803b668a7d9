"""torchvision, torchaudio and torchcodec built for another torch, found beside this one.

Such an add-on fails to import (torchvision: "operator torchvision::nms does not exist"; torchaudio:
"Could not load this library: .../_torchaudio.so"), and transformers imports torchvision whenever it
is installed, so `import transformers.modeling_utils` fails with it: every test that builds a model
errors at setup. A Python that had torch 2.14.1 and torchvision 0.29.1 before
`pip install torch==2.13.0` is in this state. kvtierd needs none of the three.

    python scripts/torch_addons.py              one line per broken add-on; exit 1 if any
    python scripts/torch_addons.py --uninstall  pip uninstall the broken ones; exit 0 when none is left

scripts/test runs the check first; CI runs --uninstall before the README's test command.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

ADDONS = ("torchvision", "torchaudio", "torchcodec")


def broken_addons() -> list[tuple[str, str, str]]:
    """(name, version, the import's last error line) of every installed add-on that fails to import."""
    found = []
    for name in ADDONS:
        if importlib.util.find_spec(name) is None:
            continue
        # A child process: a failed import leaves torch's op registry half written in this one.
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no message)"]
            found.append((name, importlib.metadata.version(name), lines[-1]))
    return found


def main(argv: list[str]) -> int:
    uninstall = argv == ["--uninstall"]
    if argv and not uninstall:
        print(f"usage: {sys.argv[0]} [--uninstall]", file=sys.stderr)
        return 2
    broken = broken_addons()
    if not broken:
        return 0
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "(none installed)"
    for name, version, error in broken:
        print(f"torch_addons: {name} {version} does not import beside torch {torch_version}: {error}", file=sys.stderr)
    names = [name for name, _, _ in broken]
    if not uninstall:
        print(f"torch_addons: kvtierd needs none of them: pip uninstall -y {' '.join(names)} (or use a fresh venv)",
              file=sys.stderr)
        return 1
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *names], check=True)
    left = broken_addons()
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
