"""Prints, as one JSON object, what the GPU machine has, and the imports every part needs.

Run by scripts/gpu-acceptance with the parts' environment (the carried site and the repository
on PYTHONPATH) before the first part. "problems" lists each import or device that is missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform

NEEDED_IMPORTS = ("kvtierd.v1.kvtier_pb2", "kvtierd.v1.kvtier_pb2_grpc", "grpc_health.v1.health",
                  "grpc_reflection.v1alpha.reflection", "lmdb", "pytest_timeout", "kvtierd.server.serve", "cupy")


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def main() -> None:
    facts = {"python": platform.python_version(), "grpcio": version("grpcio"), "protobuf": version("protobuf"),
             "problems": []}
    for module in NEEDED_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as e:  # any failure to import is a problem to report, not a crash
            facts["problems"].append(f"import {module}: {type(e).__name__}: {e}")
    import torch

    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if torch.cuda.is_available():
        facts["device"] = f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} device(s))"
    else:
        facts["problems"].append("torch.cuda.is_available() is false")
    try:
        import cupy

        facts["cupy"] = cupy.__version__
        if not cupy.cuda.is_available():
            facts["problems"].append("cupy.cuda.is_available() is false")
    except ImportError:
        pass  # already a problem above
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
