"""Loading and launching kvtierd's CUDA kernels (kernels/*.cu) with CuPy's RawModule.

CuPy is optional (`kvtierd[cuda]`) and imported only when a tensor is on CUDA; without it the
callers run their torch references. Kernels launch on torch's current stream.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch

# Where kernels/*.cu lives: kvtierd/_kernels/ in a wheel (package data mapped from kernels/),
# else the repository's top-level kernels/ (a checkout or an editable install).
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # kvtierd/
KERNEL_DIRS = (PACKAGE_DIR / "_kernels",  # installed: kernels/*.cu ship as kvtierd._kernels
               PACKAGE_DIR.parent / "kernels")  # a source checkout


def kernel_source_path(filename: str) -> Path:
    """The path of kernels/<filename>, from a checkout or from the installed package."""
    for directory in KERNEL_DIRS:
        if (directory / filename).is_file():
            return directory / filename
    raise FileNotFoundError(f"kernel source {filename} not found in {[str(d) for d in KERNEL_DIRS]}")


@functools.cache
def _cupy() -> Any | None:
    """CuPy, or None when it is not installed. Called only for CUDA tensors."""
    try:
        import cupy  # pyright: ignore[reportMissingImports]  # the optional [cuda] extra
    except ImportError:
        return None
    return cupy


def uses_cuda_kernel(tensor: torch.Tensor) -> bool:
    """True when `tensor` is on CUDA and CuPy can launch kvtierd's kernels there."""
    return tensor.is_cuda and _cupy() is not None


@functools.cache
def _raw_module(filename: str) -> Any:  # one compile per source file (and device)
    cupy = _cupy()
    assert cupy is not None, "kernels are loaded for CUDA tensors only (uses_cuda_kernel)"
    return cupy.RawModule(code=kernel_source_path(filename).read_text())


@functools.cache
def load_kernel(filename: str, kernel_name: str) -> Any:
    """The CuPy RawKernel `kernel_name` of kernels/<filename> (compiled per device on first use)."""
    return _raw_module(filename).get_function(kernel_name)


@dataclasses.dataclass(frozen=True)
class _StreamHandle:
    """A raw cudaStream_t in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""
    handle: int

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def launch_kernel(kernel: Any, device: torch.device, grid: tuple[int, ...],
                  block: tuple[int, ...], args: tuple) -> None:
    """Launch on torch's current stream of `device`, ordered with torch's own work there.

    Temporaries the kernel reads (id and pointer arrays) may be freed by the caller right after:
    torch's caching allocator reuses their memory only for later work on this same stream.
    """
    cupy = _cupy()
    assert cupy is not None, "kernels are launched for CUDA tensors only (uses_cuda_kernel)"
    handle = torch.cuda.current_stream(device).cuda_stream
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
        stream = cupy.cuda.Stream.from_external(_StreamHandle(handle))
    else:
        stream = cupy.cuda.ExternalStream(handle, device.index)
    with cupy.cuda.Device(device.index), stream:
        kernel(grid, block, args)
