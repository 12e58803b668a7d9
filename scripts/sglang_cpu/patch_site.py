"""Changes SGLang 0.5.23 (and torchvision 0.28.0) need to run HiCache on a machine without CUDA,
applied to the installed files of .venv-sglang by scripts/install-sglang-cpu.

    .venv-sglang/bin/python scripts/sglang_cpu/patch_site.py [--check]

Each change is an exact text replacement in one installed file, with the reason beside it (WHY). It is
idempotent: a file that already holds the new text is left alone; a file that holds neither the old
text exactly once nor the new text fails loudly (another SGLang version: re-derive the change). Every
new text carries the marker "kvtierd-cpu" so the changed lines are easy to find in site-packages.
--check changes nothing and exits 1 if a change is not applied yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import sys


@dataclasses.dataclass(frozen=True)
class Change:
    package: str  # the top-level package the path is in
    path: str  # relative to that package's directory
    old: str
    new: str
    why: str


CHANGES = [
    Change(
        "torchvision", "__init__.py",
        old="""from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,
""",
        new="""from torchvision import (
    _autograd_registrations,
    # kvtierd-cpu: _meta_registrations is imported under a guard below
    datasets,
""",
        why="the PyPI torchvision 0.28.0 wheel is built for CUDA torch; beside the CPU torch its C ops are not "
            "registered and _meta_registrations (fake kernels for torch.compile) fails at import, which breaks "
            "`import transformers` image utils and so SGLang. Imported below under a guard instead."),
    Change(
        "torchvision", "__init__.py",
        old="""try:
    from .version import __version__  # noqa: F401
""",
        new="""try:  # kvtierd-cpu: _meta_registrations needs torchvision's C ops, absent with a CPU torch
    from torchvision import _meta_registrations  # noqa: F401
except RuntimeError:
    pass

try:
    from .version import __version__  # noqa: F401
""",
        why="the guarded import of the line removed above: kept where it works (a matching torch)."),
    Change(
        "sglang", "srt/mem_cache/pool_host/base.py",
        old="""        self.pin_memory = pin_memory
        self.device = device
        self.allocator = get_allocator_from_storage(allocator_type)
""",
        new="""        # kvtierd-cpu: page-locked host memory needs an accelerator (torch's pin_memory and
        # cudaHostRegister both fail without one); on the CPU the host pool is plain memory.
        self.pin_memory = pin_memory and torch.accelerator.is_available()
        self.device = device
        self.allocator = get_allocator_from_storage(allocator_type)
""",
        why="the host pools default to pin_memory=True; without CUDA, pinning raises (and means nothing)."),
    Change(
        "sglang", "srt/mem_cache/pool_host/common.py",
        old="""        "xpu": alloc_with_pin_memory_xpu,
    },
)""",
        new="""        "xpu": alloc_with_pin_memory_xpu,
        # kvtierd-cpu: a CPU device pool's host pages come from plain torch.empty (with
        # pin_memory=False, see base.py): the default, alloc_with_host_register, calls cudaHostRegister.
        "cpu": alloc_with_pin_memory,
    },
)""",
        why="the allocator is chosen by the device pool's device type; 'cpu' fell to the CUDA default."),
    Change(
        "sglang", "srt/mem_cache/pool_host/mha.py",
        old="""if _is_npu:
    from sgl_kernel_npu.kvcacheio import TransferDirection, transfer_kv_dim_exchange

logger = logging.getLogger(__name__)
""",
        new="""if _is_npu:
    from sgl_kernel_npu.kvcacheio import TransferDirection, transfer_kv_dim_exchange
# kvtierd-cpu: hicache_io_backend="direct" with the layer_first layout calls transfer_kv_direct,
# imported above only for CUDA/ROCm/XPU; on the CPU it comes from sgl_kernel's CPU stand-in.
from sglang.srt.utils import is_cpu as _kvtierd_is_cpu  # noqa: E402

if _kvtierd_is_cpu():
    from sgl_kernel.kvcacheio import transfer_kv_direct

logger = logging.getLogger(__name__)
""",
        why="the direct I/O backend's copy function was not imported on the CPU (a NameError at the first copy)."),
]


def package_dir(package: str) -> pathlib.Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"patch_site: package {package} is not installed in {sys.prefix}")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a change is missing")
    args = parser.parse_args()
    missing = 0
    for change in CHANGES:
        path = package_dir(change.package) / change.path
        text = path.read_text()
        where = f"{change.package}/{change.path}"
        if change.new in text:
            continue
        count = text.count(change.old)
        if count != 1:
            raise SystemExit(f"patch_site: {where}: the text to replace is found {count} times, not once; "
                             f"is this the version the change was written for?\n--- expected:\n{change.old}")
        if args.check:
            print(f"patch_site: not applied: {where}: {change.why}", file=sys.stderr)
            missing += 1
            continue
        path.write_text(text.replace(change.old, change.new))
        print(f"patch_site: patched {where}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
