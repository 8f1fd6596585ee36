"""Importing batchrules is silent and cheap: no warnings, no output, and none of
the optional torch subsystems it hooks into (dynamo, DTensor) imported."""
import os
import subprocess
import sys

import pytest

import batchrules


def run_child(code: str, *flags: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter that imports the same batchrules as this
    process (in place or installed)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(batchrules.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True,
                          timeout=180, env=env, cwd=os.path.dirname(package_root))


def test_import_prints_no_warnings() -> None:
    result = run_child("import batchrules", "-W", "error")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


def test_import_leaves_dynamo_and_dtensor_alone() -> None:
    result = run_child("import sys, batchrules; "
                       "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor') "
                       "if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


COMPILE_VMAP = (
    "import torch, batchrules\n"
    "from torch.func import vmap\n"
    "x, w, b = torch.randn(5, 4), torch.randn(3, 6, 4), torch.randn(3, 6)\n"
    "f = torch.compile(lambda x, w, b: vmap(batchrules.linear, (None, 0, 0))(x, w, b),\n"
    "                  backend='eager', fullgraph=True)\n"
    "torch.testing.assert_close(f(x, w, b), vmap(batchrules.linear, (None, 0, 0))(x, w, b))\n"
    "print('ok')\n"
)


@pytest.mark.parametrize("dynamo_first", [False, True])
def test_compile_polyfill_registers_in_either_import_order(dynamo_first: bool) -> None:
    """The polyfill is registered when torch._dynamo is imported, before or after
    batchrules; fullgraph compile of vmap(batchrules.linear) then needs no graph break."""
    prefix = "import torch._dynamo\n" if dynamo_first else ""
    result = run_child(prefix + COMPILE_VMAP)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
