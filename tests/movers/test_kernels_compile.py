"""Every kernels/*.cu compiles with nvcc for sm_80 and sm_90, and exports every kernel name the
Python wrappers launch (read from the cubin's ELF symbol table, so a renamed kernel cannot land)."""

from __future__ import annotations

import glob
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kvtierd.movers import cuda_kernels, fp8_codec, layout_kernels

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
ARCHS = ("sm_80", "sm_90")
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
WRAPPER_KERNEL_NAMES = {**layout_kernels.KERNEL_NAMES, **fp8_codec.KERNEL_NAMES}


def _find_nvcc() -> str | None:
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    installed = sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)
    return installed[0] if installed else None


NVCC = _find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is neither on PATH nor in /usr/local/cuda*/bin")


def elf_global_functions(cubin: bytes) -> set[str]:
    """Names of the global function symbols (kernel entry points) of a 64-bit ELF cubin."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2, "not a 64-bit ELF file"
    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, num_sections = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size)
                for i in range(num_sections)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, sym_size in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab_offset = sections[link][4]
        for sym in range(offset, offset + size, sym_size):
            name_offset, info = struct.unpack_from("<IB", cubin, sym)
            if info & 0xF == 2 and info >> 4 == 1:  # STT_FUNC, STB_GLOBAL
                end = cubin.index(b"\0", strtab_offset + name_offset)
                names.add(cubin[strtab_offset + name_offset:end].decode())
    return names


@pytest.fixture(scope="module")
def compile_cubin(tmp_path_factory):
    """compile_cubin(source, arch) -> cubin bytes; each (source, arch) is compiled once."""
    out_dir = tmp_path_factory.mktemp("cubin")
    cache: dict[tuple[Path, str], bytes] = {}

    def compile_once(source: Path, arch: str) -> bytes:
        if (source, arch) not in cache:
            out = out_dir / f"{source.stem}.{arch}.cubin"
            result = subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-o", str(out), str(source)],
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"nvcc failed on {source.name} for {arch}:\n{result.stderr}"
            cache[(source, arch)] = out.read_bytes()
        return cache[(source, arch)]

    return compile_once


def test_every_wrapped_kernel_source_is_in_kernels_dir():
    """The sources the wrappers load are the ones this test compiles."""
    assert set(WRAPPER_KERNEL_NAMES) <= {source.name for source in SOURCES}
    for filename in WRAPPER_KERNEL_NAMES:
        assert cuda_kernels.kernel_source_path(filename) == KERNEL_DIR / filename


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda source: source.name)
def test_kernel_source_compiles(compile_cubin, source, arch):
    """nvcc -cubin succeeds and yields an ELF with at least one kernel entry point."""
    assert elf_global_functions(compile_cubin(source, arch))


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", sorted(WRAPPER_KERNEL_NAMES))
def test_wrapper_kernel_names_are_exported(compile_cubin, filename, arch):
    """Every name a wrapper passes to get_function is an extern "C" entry of the compiled code."""
    exported = elf_global_functions(compile_cubin(KERNEL_DIR / filename, arch))
    missing = set(WRAPPER_KERNEL_NAMES[filename]) - exported
    assert not missing, f"{filename} ({arch}) lacks kernels {sorted(missing)}; it has {sorted(exported)}"
