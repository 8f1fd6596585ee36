"""Build the batchrules C++ extension against the torch that is already installed.

Install with ``pip install --no-build-isolation -e .`` (or without ``-e``), so
the extension is compiled for the torch in this environment; see Note [Building
against the installed torch]. ``DEBUG=1`` builds with ``-O0 -g``; otherwise
``-O3 -g0``: no debug info (Python's CFLAGS ask for ``-g``), which took more
than half of each file's compile time (torch's headers) and all but 1.8 MB
of the 78 MB built library.

Note [Building against the installed torch]
A C++ extension is only ABI-compatible with the exact torch it was compiled
against. So torch is neither pinned (pip would replace the user's torch, CUDA
build included, to satisfy the pin) nor a build requirement (an isolated build
would download the newest torch into a throwaway environment and compile
against that one instead of the installed one). The build writes
``batchrules/_build_info.py`` with the torch it used, next to the extension
(in place for ``-e``, into the wheel otherwise), and ``import batchrules``
compares it with the running torch before loading the extension.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:
    sys.exit(
        "batchrules compiles its C++ extension against the installed torch, but torch cannot be "
        f"imported by this build ({e}): torch is not installed, or pip isolated the build from "
        "it. Install torch first, then build without build isolation: "
        "pip install --no-build-isolation -e .")

# The oldest torch batchrules builds against; pyproject.toml's dependency says the same.
MIN_TORCH = "2.13"
if torch.__version__ < MIN_TORCH:
    sys.exit(f"batchrules needs torch >= {MIN_TORCH}, but torch {torch.__version__} is installed: "
             f'pip install "torch>={MIN_TORCH}", then pip install --no-build-isolation -e .')

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join("batchrules", "_build_info.py")


def nlohmann_include_dirs() -> list:
    # torch's ATen/functorch/Interpreter.h includes <nlohmann/json.hpp> (2.13
    # and 2.14), which the wheels do not ship; the PyPI package nlohmann-json does.
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


def build_record(in_place: bool) -> str:
    """Source of batchrules/_build_info.py: the torch this build compiled against."""
    values = {
        "TORCH_VERSION": str(torch.__version__),
        "TORCH_GIT_VERSION": torch.version.git_version,
        "TORCH_CUDA": torch.version.cuda,
        "PYTHON_VERSION": "%d.%d" % sys.version_info[:2],
        "SOURCE_DIR": HERE,
        "IN_PLACE": in_place,
    }
    lines = ['"""Written by setup.py when the C++ extension was built; checked by',
             'batchrules/_build_check.py at import. Not tracked by git."""']
    lines += [f"{name} = {value!r}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


class BuildWithRecord(BuildExtension):
    """BuildExtension that also writes the build record next to the extension."""

    def run(self) -> None:
        super().run()
        # In place (-e, build_ext --inplace): the package is imported from the
        # source tree. Otherwise into build_lib, whose contents make the wheel.
        target = os.path.join(HERE if self.inplace else self.build_lib, BUILD_INFO)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(build_record(bool(self.inplace)))


debug = os.getenv("DEBUG", "0") == "1"
cxx_flags = ["-O0", "-g"] if debug else ["-O3", "-g0"]

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
    cmdclass={"build_ext": BuildWithRecord.with_options(use_ninja=True)},
)
