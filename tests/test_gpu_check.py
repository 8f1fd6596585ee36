"""``python -m batchrules.bench --gpu-check`` on a machine (or with a setting) that shows no GPU:
it reports that plainly, in its output and summary.json, and fails without a traceback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import batchrules

ROOT = Path(batchrules.__file__).resolve().parent.parent


def test_without_a_gpu_it_reports_no_cuda_device(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "batchrules.bench", "--gpu-check", str(tmp_path)],
                            capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "[gpu_check] no CUDA device visible to torch" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"] == "no CUDA device" and summary["ok"] is False
    assert summary["steps"] == {}
    assert summary["torch"] == str(torch.__version__) == summary["built_for_torch"]
