"""Build the batchrules C++ extension against the torch that is already installed.

Install with ``pip install --no-build-isolation -e .`` (or without ``-e``), so
the extension is compiled for the torch in this environment; see Note [Building
against the installed torch]. ``DEBUG=1`` builds with ``-O0 -g``; otherwise
``-O3 -g0``: no debug info (Python's CFLAGS ask for ``-g``), which would take
more than half of each file's compile time (torch's headers) and most of the
built library. With GCC, torch's headers are precompiled once per
build (Note [Precompiled torch headers]); ``BATCHRULES_PCH=0`` builds without.
Each csrc folder compiles as a few unity files (Note [Unity build]);
``BATCHRULES_UNITY=0`` compiles each source file alone.

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
import hashlib
import os
import subprocess
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, get_cxx_compiler
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
TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")
BUILD_INFO = os.path.join("batchrules", "_build_info.py")


def nlohmann_include_dirs() -> list:
    # torch's ATen/functorch/Interpreter.h includes <nlohmann/json.hpp> (2.13
    # and 2.14), which the wheels do not ship; the PyPI package nlohmann-json does.
    header = os.path.join(TORCH_INCLUDE, "ATen", "functorch", "Interpreter.h")
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


# Note [Precompiled torch headers]
# Parsing torch's headers is most of each file's compile time. csrc/
# precompiled.h names the headers most files include; GCC compiles it once per
# build into a .gch, and every file is compiled with `-include` of it, which
# loads the parsed headers instead of parsing them again (the .gch takes
# ~500 MB of the build directory). It is
# only valid for the exact flags it was built with, so it is compiled by the
# same compiler with the flags torch's ninja build gives every file, and rebuilt
# when they, the header or torch change; GCC checks its validity itself and
# falls back to parsing (a -Winvalid-pch warning) rather than miscompiling.
# torch's include directories are also passed as -isystem: a pending template
# instantiation in the precompiled headers would otherwise warn (-Wsign-compare)
# in every file.
PCH_HEADER = os.path.join(HERE, "csrc", "precompiled.h")


def precompiled_header_enabled() -> bool:
    if os.getenv("BATCHRULES_PCH", "1") == "0":
        return False
    try:
        version = subprocess.run([get_cxx_compiler(), "--version"], capture_output=True,
                                 text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return "Free Software Foundation" in version and "clang" not in version


def _read(path: str):
    """The text of `path`, or None when there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def precompile(command: list, header: str, text: str) -> None:
    """Writes `text` to `header` and runs `command` (its .gch), unless the .gch
    of this exact command and text is there already."""
    key = hashlib.sha256("\0".join(command + [text]).encode()).hexdigest()
    stamp = header + ".gch.key"
    if _read(stamp) == key:
        return
    os.makedirs(os.path.dirname(header), exist_ok=True)
    with open(header, "w") as f:
        f.write(text)
    print("precompiling torch's headers:", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    with open(stamp, "w") as f:
        f.write(key)


def compile_with_precompiled_header(compiler, build_temp: str):
    """Wraps torch's ninja `compile` so that every file is compiled with the
    precompiled torch headers, built first with the same flags."""
    ninja_compile = compiler.compile

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                extra_preargs=None, extra_postargs=None, depends=None):
        # -isystem hides torch's headers from ninja's dependency files too: the
        # torch build below is in every command instead, so that a new torch
        # rebuilds every file (ninja rebuilds a file whose command changed).
        torch_build = hashlib.sha256(f"{torch.__version__} {torch.version.git_version}".encode())
        post_cflags = [*extra_postargs["cxx"],
                       *[flag for d in include_dirs or [] if d.startswith(TORCH_INCLUDE)
                         for flag in ("-isystem", d)],
                       f"-DBATCHRULES_TORCH_BUILD={torch_build.hexdigest()[:16]}"]
        # The flags torch's ninja rule gives each file: $cxx $cflags -c $in -o $out $post_cflags.
        _, _, _, pp_opts, _ = compiler._setup_compile(output_dir, macros, include_dirs, [],
                                                      depends, extra_postargs)
        cflags = compiler.compiler_so[1:] + compiler._get_cc_args(pp_opts, debug, extra_preargs)
        header = os.path.abspath(os.path.join(build_temp, "pch", "precompiled.h"))
        with open(PCH_HEADER) as f:
            precompile([get_cxx_compiler(), *cflags, "-x", "c++-header", header,
                        "-o", header + ".gch", *post_cflags], header, f.read())
        post_cflags += ["-include", header, "-Winvalid-pch"]
        return ninja_compile(sources, output_dir, macros, include_dirs, debug, extra_preargs,
                             dict(extra_postargs, cxx=post_cflags), depends)

    return compile


# Note [Unity build]
# Even precompiled, torch's headers cost every compiled file more to load than
# most files' own code takes: a build file by file spends most of its time
# loading them. So each csrc folder (an op family; csrc's own files together)
# compiles as unity files that #include its sources, at most UNITY_FILES each:
# a few loads a folder, and enough units to keep both cores busy. The sources
# stay one concern per file and each includes what it uses; names in their
# anonymous namespaces are unique within a folder (the same definition twice
# fails to compile, but other parameters would overload). ninja's dependency
# files list the included sources, so editing one rebuilds its unit.
# BATCHRULES_UNITY=0 compiles each file alone.
UNITY_FILES = 6


def unity_sources(sources: list, directory: str) -> list:
    """The unity files that compile `sources` (csrc's files), written under
    `directory` where their text changed; each includes its sources by their
    paths relative to csrc/ (an include directory); a folder's sorted files
    are dealt in turn to its units."""
    groups = {}
    for source in sorted(sources):
        relative = os.path.relpath(source, os.path.join(HERE, "csrc"))
        groups.setdefault(os.path.dirname(relative) or "csrc", []).append(relative)
    os.makedirs(directory, exist_ok=True)
    units = []
    for folder, members in groups.items():
        count = -(-len(members) // UNITY_FILES)  # ceil: chunks of near-equal size
        for i in range(count):
            unit = os.path.join(directory, f"{folder.replace(os.sep, '_')}_{i}.cpp")
            text = "".join(f'#include "{m}"\n' for m in members[i::count])
            if _read(unit) != text:  # an unchanged unit keeps its time: ninja skips it
                with open(unit, "w") as f:
                    f.write(text)
            units.append(unit)
    return units


class BuildWithRecord(BuildExtension):
    """BuildExtension that also writes the build record next to the extension,
    and compiles unity files (Note [Unity build]) with precompiled torch headers
    (Note [Precompiled torch headers])."""

    def build_extension(self, ext) -> None:
        # torch's build_extensions has installed its ninja `compile` by now.
        if precompiled_header_enabled():
            self.compiler.compile = compile_with_precompiled_header(self.compiler,
                                                                    self.build_temp)
        if os.getenv("BATCHRULES_UNITY", "1") != "0":
            ext.sources = unity_sources([os.path.abspath(s) for s in ext.sources],
                                        os.path.join(self.build_temp, "unity"))
        super().build_extension(ext)

    def run(self) -> None:
        super().run()
        # In place (-e, build_ext --inplace): the package is imported from the
        # source tree. Otherwise into build_lib, whose contents make the wheel.
        target = os.path.join(HERE if self.inplace else self.build_lib, BUILD_INFO)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(build_record(bool(self.inplace)))


debug = os.getenv("DEBUG", "0") == "1"
# -std as torch's build would add it, but before the precompiled header is built.
# -fopenmp: at::parallel_for is an OpenMP loop compiled into the caller, serial
# without it; the OpenMP runtime is torch's (its libgomp.so.1, loaded first).
cxx_flags = (["-O0", "-g"] if debug else ["-O3", "-g0"]) + ["-std=c++20", "-fopenmp"]

setup(
    name="batchrules",
    packages=find_packages(include=["batchrules", "batchrules.*"]),
    package_data={"batchrules": ["_C.pyi"]},  # the extension's types, for type checkers
    ext_modules=[
        CppExtension(
            "batchrules._C",
            sorted(glob.glob("csrc/**/*.cpp", recursive=True)),
            include_dirs=[os.path.abspath("csrc")] + nlohmann_include_dirs(),
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp", *(["-g"] if debug else [])],
        )
    ],
    cmdclass={"build_ext": BuildWithRecord.with_options(use_ninja=True)},
)
