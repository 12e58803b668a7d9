"""What travels to the GPU machine beside the git tree, and installing it there.

The GPU machine (shared/TOOLING.md) has Python 3.12, torch, CuPy, grpcio, protobuf and pytest
but no lmdb, no grpcio-health-checking / -reflection, no redis / hiredis (T3's client), no
msgspec / pyzmq (the KV event feed) — the daemon imports them all — and no network. Their
wheels are downloaded here for CPython 3.12 manylinux x86_64, each at the version installed
here, into TRAVEL_DIR/wheels (gitignored). grpcio and protobuf travel too, because the
generated modules kvtierd/v1/*_pb2*.py (gitignored, built by `pip install` in setup.py's build_py)
refuse an older runtime at import: there a carried wheel is installed only when the machine's
copy of that distribution is missing or older than the carried one.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAVEL_DIR = ".gpu-travel"
WHEELS_DIR = f"{TRAVEL_DIR}/wheels"
SITE_DIR = f"{TRAVEL_DIR}/site"  # made there: pip install --target
GENERATED = ("kvtierd/v1/kvtier_pb2.py", "kvtierd/v1/kvtier_pb2_grpc.py")
# Distributions to carry: the daemon's imports the GPU machine lacks, pytest-timeout (per-test
# time limits), and the runtimes the generated code checks.
DISTRIBUTIONS = ("lmdb", "grpcio-health-checking", "grpcio-reflection", "pytest-timeout", "grpcio", "protobuf",
                 "redis", "hiredis", "msgspec", "pyzmq")  # the T3 client and the KV event feed
MAX_CARRY_PATHS = 8
MAX_CARRY_BYTES = 64 << 20
PIP_DOWNLOAD = ["download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64"]


class TravelError(Exception):
    """What is missing or too big; the message is the one-line reason."""


def carry_paths() -> list[str]:
    """The ignored paths the device call must name in `carry`, relative to the repository root."""
    return [TRAVEL_DIR, *GENERATED]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:4])


def prepare(log=print) -> list[Path]:
    """Downloads any missing wheel (the versions installed here), drops stale ones; checks the
    generated modules exist. Returns the wheels."""
    for generated in GENERATED:
        if not (REPO / generated).is_file():
            raise TravelError(f"{generated} is missing: `pip install -e .` builds it (setup.py build_py)")
    wheels_dir = REPO / WHEELS_DIR
    wheels_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(REPO / SITE_DIR, ignore_errors=True)  # only wheels travel
    try:
        wanted = {normalize(dist): importlib.metadata.version(dist) for dist in DISTRIBUTIONS}
    except importlib.metadata.PackageNotFoundError as e:
        raise TravelError(f"{e.name} is not installed here: `pip install -e '.[dev]'` first") from e
    for path in wheels_dir.glob("*.whl"):
        if wanted.get(wheel_name_version(path)[0]) != wheel_name_version(path)[1]:
            path.unlink()
    have = {wheel_name_version(path) for path in wheels_dir.glob("*.whl")}
    missing = [f"{dist}=={wanted[normalize(dist)]}" for dist in DISTRIBUTIONS
               if (normalize(dist), wanted[normalize(dist)]) not in have]
    if missing:
        log(f"gpu-acceptance: pip download {' '.join(missing)}")
        done = subprocess.run([sys.executable, "-m", "pip", *PIP_DOWNLOAD, "-d", str(wheels_dir), *missing],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise TravelError(f"pip download failed: {done.stderr.strip().splitlines()[-1:]}")
    return sorted(wheels_dir.glob("*.whl"))


def generated_needs() -> dict[str, str]:
    """The oldest runtimes the generated modules accept: {"protobuf": "7.35.1", "grpcio": "1.85.1"}."""
    pb2 = (REPO / GENERATED[0]).read_text()
    grpc = (REPO / GENERATED[1]).read_text()
    protobuf = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    grpcio = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc)
    if not (protobuf and grpcio):
        raise TravelError(f"cannot read the gencode versions of {GENERATED[0]} / {GENERATED[1]}")
    return {"protobuf": ".".join(protobuf.groups()), "grpcio": grpcio.group(1)}


def check_generated_runtimes(wheels: list[Path]) -> dict[str, str]:
    """The carried protobuf and grpcio are at least what the generated modules need."""
    carried = dict(wheel_name_version(wheel) for wheel in wheels)
    needs = generated_needs()
    for dist, needed in needs.items():
        if version_key(carried.get(dist, "0")) < version_key(needed):
            raise TravelError(f"the generated code needs {dist}>={needed}, the carried wheel is "
                              f"{carried.get(dist, 'missing')}")
    return needs


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_fits() -> int:
    """The carried bytes; a TravelError when the carry breaks the device call's limits."""
    paths = carry_paths()
    if len(paths) > MAX_CARRY_PATHS:
        raise TravelError(f"{len(paths)} carry paths, the device call takes at most {MAX_CARRY_PATHS}")
    nbytes = sum(path_bytes(REPO / p) for p in paths)
    if nbytes > MAX_CARRY_BYTES:
        raise TravelError(f"the carry is {nbytes / 2**20:.1f} MiB, the device call takes at most 64 MiB")
    return nbytes


def machine_version(dist_key: str) -> str | None:
    for dist in importlib.metadata.distributions():
        if normalize(dist.metadata["Name"] or "") == dist_key:
            return dist.version
    return None


def install_there(log=print) -> dict[str, str]:
    """On the GPU machine: installs each carried wheel the machine lacks (or has older) into
    SITE_DIR with pip (`--no-index --no-deps --target`), or by unzipping it without pip.
    Returns {distribution: what was done}."""
    site = REPO / SITE_DIR
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    actions, to_install = {}, []
    for wheel in sorted((REPO / WHEELS_DIR).glob("*.whl")):
        name, version = wheel_name_version(wheel)
        present = machine_version(name)
        if present is not None and version_key(present) >= version_key(version):
            actions[name] = f"the machine's {present} (carried {version} not needed)"
        else:
            actions[name] = f"carried {version} installed (the machine has {present or 'none'})"
            to_install.append(wheel)
    if not to_install:
        return actions
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        log("gpu-acceptance: no pip here; unzipping the wheels into the site instead")
        for wheel in to_install:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        return actions
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(site),
                           *map(str, to_install)], capture_output=True, text=True)
    if done.returncode != 0:
        raise TravelError(f"pip install of the carried wheels failed: {done.stderr.strip()[-300:]}")
    return actions
