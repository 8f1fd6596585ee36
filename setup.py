"""Build the batchrules C++ extension against the torch that is already installed.

Install with ``pip install --no-build-isolation .`` so the extension is compiled
for that torch (build isolation would fetch another one). ``DEBUG=1`` builds
with ``-O0 -g``; otherwise ``-O3``.
"""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def nlohmann_include_dirs() -> list:
    # torch 2.13's ATen/functorch/Interpreter.h includes <nlohmann/json.hpp>,
    # which the wheel does not ship; the PyPI package nlohmann-json does.
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "functorch",
                          "Interpreter.h")
    with open(header) as f:
        if "nlohmann/json.hpp" not in f.read():
            return []
    try:
        import nlohmann_json
    except ImportError as e:
        raise RuntimeError(
            "batchrules needs the nlohmann/json headers to build against torch's "
            "functorch headers: pip install nlohmann-json") from e
    return [os.path.join(os.path.dirname(nlohmann_json.__file__), "include")]


debug = os.getenv("DEBUG", "0") == "1"
cxx_flags = ["-O0", "-g"] if debug else ["-O3"]

setup(
    name="batchrules",
    packages=find_packages(include=["batchrules", "batchrules.*"]),
    ext_modules=[
        CppExtension(
            "batchrules._C",
            sorted(glob.glob("csrc/**/*.cpp", recursive=True)),
            include_dirs=[os.path.abspath("csrc")] + nlohmann_include_dirs(),
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-g"] if debug else [],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
