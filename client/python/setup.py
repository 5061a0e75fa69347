"""pip install ./client/python (from the repository: the stubs are generated
from ../../proto with protoc and grpc_python_plugin, Debian's
protobuf-compiler and protobuf-compiler-grpc). Needs grpcio, protobuf and
numpy (Debian: python3-grpcio python3-protobuf python3-numpy; in a venv,
--system-site-packages reuses them)."""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto")


def generate(out_dir):
    plugin = shutil.which("grpc_python_plugin")
    if plugin is None or shutil.which("protoc") is None:
        raise RuntimeError("protoc and grpc_python_plugin are needed "
                           "(apt-get install protobuf-compiler protobuf-compiler-grpc)")
    os.makedirs(os.path.join(out_dir, "ropeattn", "v1"), exist_ok=True)
    subprocess.check_call([
        "protoc", "-I", PROTO, "--python_out", out_dir, "--grpc_out", out_dir,
        "--plugin=protoc-gen-grpc=" + plugin, "ropeattn/v1/attention.proto"])
    open(os.path.join(out_dir, "ropeattn", "v1", "__init__.py"), "a").close()


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        generate(self.build_lib)


setup(
    name="ropeattn",
    version="1.0.0",
    description="Python client of the ropeattn RoPE attention server",
    packages=["ropeattn"],
    python_requires=">=3.9",
    install_requires=["grpcio", "protobuf", "numpy"],
    cmdclass={"build_py": BuildWithStubs},
)
