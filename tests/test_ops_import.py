"""Importing batchrules is silent: no warnings, no output."""
import os
import subprocess
import sys

import batchrules


def test_import_prints_no_warnings() -> None:
    # The child imports the same batchrules as this process (in place or installed).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(batchrules.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import batchrules"],
                            capture_output=True, text=True, timeout=120, env=env,
                            cwd=os.path.dirname(package_root))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""
