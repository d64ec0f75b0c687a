"""Builds the xfer package, generating the gRPC stubs from ../proto (or ./proto in an sdist)."""
import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    """build_py that first runs grpc_tools.protoc on xfer/v1/xfer.proto into the build tree."""

    def run(self):
        import grpc_tools
        from grpc_tools import protoc

        proto_root = next(p for p in (HERE.parent / "proto", HERE / "proto") if (p / "xfer/v1/xfer.proto").exists())
        out = pathlib.Path(self.build_lib)
        (out / "xfer" / "v1").mkdir(parents=True, exist_ok=True)
        well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto_root / "xfer/v1/xfer.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
