"""Builds the gRPC code of proto/kvtierd/v1/*.proto into kvtierd/v1/ before the package is built,
and the optional C extensions: the block-hash chain's loop (kernels/hash_chain.c -> kvtierd._hash_chain)
and the host copy engine's batched memcpy (kernels/copy_spans.c -> kvtierd._copy_spans).

The generated modules are not committed (.gitignore). Because the proto path equals the Python
package path (kvtierd/v1), `from kvtierd.v1 import kvtier_pb2` works without import rewriting.
Both `pip install .` and `pip install -e .` run build_py.

Both are optional: where no C compiler is found, setuptools warns and the package installs without
them (kvtierd/hash_chain_native.py then answers None and the Python loop hashes; span_copy.py copies
span by span in Python).
"""

import glob
import os

from setuptools import Extension, setup
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


HASH_CHAIN = Extension("kvtierd._hash_chain", sources=["kernels/hash_chain.c"], optional=True,
                       extra_compile_args=["-O2"])
COPY_SPANS = Extension("kvtierd._copy_spans", sources=["kernels/copy_spans.c"], optional=True,
                       extra_compile_args=["-O2"])

setup(cmdclass={"build_py": BuildPyWithProtos}, ext_modules=[HASH_CHAIN, COPY_SPANS])
