"""batchrules works with the torch users have: no torch pin, and an extension
built for another torch is refused at import with an ImportError that says
which torch it was built for, which is installed, and how to rebuild, before
the extension is loaded (see Note [Building against the installed torch] in
setup.py). The real upgrade (build on 2.13.0, install 2.14.1) runs in .ci/run.
"""
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

import batchrules
from batchrules import _build_check, _build_info

PACKAGE_DIR = Path(batchrules.__file__).resolve().parent
ROOT = PACKAGE_DIR.parent

# Imports batchrules and reports how: the error, and whether the extension got loaded.
IMPORT_AND_REPORT = """
import sys
try:
    import batchrules
except ImportError as e:
    print("ImportError:", e)
print("extension loaded:", "batchrules._C" in sys.modules)
"""


def run_child(code: str, package_parent: Path = ROOT) -> str:
    """Runs ``code`` in a fresh interpreter that finds batchrules in ``package_parent``."""
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=180, env=env, cwd=package_parent)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def expected_rebuild_command() -> str:
    if _build_info.IN_PLACE:
        return f"pip install --no-build-isolation -e {ROOT}"
    return f"pip install --no-build-isolation {_build_info.SOURCE_DIR}"


def test_build_record_is_the_running_torch() -> None:
    assert _build_info.TORCH_VERSION == str(torch.__version__)
    assert _build_info.TORCH_GIT_VERSION == torch.version.git_version
    assert _build_info.TORCH_CUDA == torch.version.cuda
    assert _build_info.PYTHON_VERSION == "%d.%d" % sys.version_info[:2]
    assert (Path(_build_info.SOURCE_DIR) / "setup.py").is_file()
    assert _build_check.mismatch(_build_info) is None


@pytest.mark.parametrize("fake", ["2.99.0+fake", "2.13.0.dev20990101"])
def test_other_torch_version_is_a_clear_import_error(fake: str) -> None:
    out = run_child(f"import torch; torch.__version__ = {fake!r}\n" + IMPORT_AND_REPORT)
    assert f"built for torch {_build_info.TORCH_VERSION}, but torch {fake} is installed" in out
    assert expected_rebuild_command() in out
    assert "extension loaded: False" in out


def test_other_torch_commit_is_a_clear_import_error() -> None:
    out = run_child("import torch; torch.version.git_version = 'f' * 40\n" + IMPORT_AND_REPORT)
    assert f"at commit {_build_info.TORCH_GIT_VERSION}" in out
    assert f"is commit {'f' * 40}" in out
    assert expected_rebuild_command() in out
    assert "extension loaded: False" in out


@pytest.mark.parametrize("with_setup_py", [True, False])
def test_missing_build_record_is_a_clear_import_error(tmp_path: Path, with_setup_py: bool) -> None:
    """A package with its extension but no build record (built before records, or copied)."""
    shutil.copytree(PACKAGE_DIR, tmp_path / "batchrules",
                    ignore=shutil.ignore_patterns("_build_info.py", "__pycache__", "bench",
                                                  "examples"))
    if with_setup_py:
        shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    out = run_child(IMPORT_AND_REPORT, package_parent=tmp_path)
    assert "ImportError: batchrules: the C++ extension has not been built" in out
    assert f"installed torch {torch.__version__}" in out
    if with_setup_py:
        assert f"pip install --no-build-isolation -e {tmp_path}\n" in out
    else:
        assert "pip install --no-build-isolation <path of a batchrules checkout>" in out
    assert "extension loaded: False" in out


def record(source_dir: Optional[str], in_place: bool) -> types.ModuleType:
    info = types.ModuleType("batchrules._build_info")
    info.SOURCE_DIR, info.IN_PLACE = source_dir, in_place  # type: ignore[attr-defined]
    return info


def test_rebuild_command_follows_the_install_kind(tmp_path: Path) -> None:
    (tmp_path / "setup.py").touch()
    # In place: the checkout the package is imported from, wherever it was built.
    assert _build_check.rebuild_command(record(str(tmp_path), True)) == \
        f"pip install --no-build-isolation -e {ROOT}"
    # A regular install from a checkout that still exists: reinstall from it.
    assert _build_check.rebuild_command(record(str(tmp_path), False)) == \
        f"pip install --no-build-isolation {tmp_path}"
    # The checkout is gone (e.g. a wheel built elsewhere).
    gone = record(str(tmp_path / "gone"), False)
    assert _build_check.rebuild_command(gone) == \
        "pip install --no-build-isolation <path of a batchrules checkout>"


def test_no_exact_torch_pin() -> None:
    """pip must keep the user's torch (a CUDA build included): a floor, no pin, and
    no torch in the isolated build environment."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = re.search(r'MIN_TORCH = "([0-9.]+)"', (ROOT / "setup.py").read_text()).group(1)
    torch_deps = [d for d in project["project"]["dependencies"] if d.startswith("torch")]
    assert torch_deps == [f"torch>={floor}"]
    assert not any(r.startswith("torch") for r in project["build-system"]["requires"])


def test_ci_runs_the_readme_quickstart_verbatim() -> None:
    """.ci/run runs the README quickstart's two commands as written, and the
    install command keeps an installed torch (a floor, never torch==)."""
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    commands = re.findall(r"```bash\n(.+?)\n```", quickstart)[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands == [re.search(rf"^{name}='(.+)'$", ci, re.M).group(1)
                        for name in ("QUICKSTART_INSTALL_AND_BENCH", "QUICKSTART_TEST")]
    assert "torch==" not in commands[0] and '"torch>=' in commands[0]


def run_setup_py(prelude: str) -> subprocess.CompletedProcess:
    """``setup.py --name`` after ``prelude`` (which changes what torch looks like)."""
    code = (prelude + "\nimport runpy, sys; sys.argv = ['setup.py', '--name']\n"
            "runpy.run_path('setup.py', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_setup_py_without_torch_explains_the_build() -> None:
    result = run_setup_py("import sys; sys.modules['torch'] = None")
    assert result.returncode != 0
    assert "torch cannot be imported by this build" in result.stderr
    assert "pip install --no-build-isolation -e ." in result.stderr


def test_setup_py_rejects_a_torch_below_the_floor() -> None:
    result = run_setup_py("import torch; torch.__version__ = torch.torch_version.TorchVersion('2.12.1')")
    assert result.returncode != 0
    assert "batchrules needs torch >= 2.13, but torch 2.12.1 is installed" in result.stderr


def test_setup_py_accepts_the_installed_torch() -> None:
    result = run_setup_py("")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "batchrules"
