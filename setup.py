"""Builds the gRPC code of proto/kvtierd/v1/*.proto into kvtierd/v1/ before the package is built.

The generated modules are not committed (.gitignore). Because the proto path equals the Python
package path (kvtierd/v1), `from kvtierd.v1 import kvtier_pb2` works without import rewriting.
Both `pip install .` and `pip install -e .` run build_py.
"""

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def build_protos() -> None:
    from grpc_tools import protoc

    protos = sorted(glob.glob(os.path.join(HERE, "proto", "kvtierd", "v1", "*.proto")))
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    for proto in protos:
        args = ["grpc_tools.protoc", f"-I{os.path.join(HERE, 'proto')}", f"-I{include}",
                f"--python_out={HERE}", f"--pyi_out={HERE}", f"--grpc_python_out={HERE}", proto]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        build_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
