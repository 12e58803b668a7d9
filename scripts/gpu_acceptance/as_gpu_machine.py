"""Runs a module, a script or code here as it would import on the GPU machine.

`python as_gpu_machine.py -m pytest ARGS`, `... -c CODE`, `... SCRIPT ARGS`: the packages the
GPU machine does not have (and that do not travel) are None in sys.modules, so importing one
raises ModuleNotFoundError and importlib.util.find_spec says None, as there; the dry run sees an
import the machine could not satisfy. What travels (lmdb, grpcio-health-checking, -reflection,
pytest-timeout, redis, hiredis, msgspec, pyzmq) stays importable: it is installed here too.
"""

from __future__ import annotations

import os
import runpy
import sys

# Not on the GPU machine (shared/TOOLING.md says so, or does not list them) and not carried.
ABSENT = ("vllm", "grpc_tools", "gguf", "accelerate", "kubernetes_validate", "grpcurl")


def main() -> None:
    for name in ABSENT:
        sys.modules[name] = None
    mode, *rest = sys.argv[1:]
    if mode == "-m":
        sys.argv = rest
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif mode == "-c":
        sys.argv = ["-c", *rest[1:]]
        exec(compile(rest[0], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = [mode, *rest]
        runpy.run_path(mode, run_name="__main__")


if __name__ == "__main__":
    main()
