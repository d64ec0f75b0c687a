"""Builds the xfer package, generating the gRPC stubs from ./proto/xfer/v1/xfer.proto, a copy of the
repository's proto/ kept in the package (scripts/python-test fails when the two differ), so the
package builds from a copy of this directory anywhere."""
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    """build_py that first runs grpc_tools.protoc on xfer/v1/xfer.proto into the build tree."""

    def run(self):
        import grpc_tools
        from grpc_tools import protoc

        proto_root = HERE / "proto"
        if not (proto_root / "xfer/v1/xfer.proto").exists():
            raise RuntimeError(f"{proto_root}/xfer/v1/xfer.proto is missing: the package carries its own copy of the proto")
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
