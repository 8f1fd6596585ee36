"""``python -m batchrules.bench --gpu-check OUT_DIR``: one check of an already
built batchrules on a GPU machine. Runs, each under its timeout, ``pytest
tests/test_cuda.py`` (a skip fails the step) and the headline bench on cuda (its
numbers in ``bench.json``). Writes ``<step>.log`` per step, ``test_cuda.xml`` and
``summary.json`` into OUT_DIR; returns 0 when every step passed.
"""
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Dict, List

import torch

import batchrules
from batchrules import _build_info

TIMEOUT_S = {"test_cuda": 100, "bench": 100}
PACKAGE_ROOT = Path(batchrules.__file__).resolve().parent.parent


def run_step(name: str, cmd: List[str], out_dir: Path) -> Dict[str, Any]:
    """Runs ``cmd`` with its output in ``out_dir/<name>.log``; never raises."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    with open(out_dir / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc: Any = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     timeout=TIMEOUT_S[name]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = round(time.monotonic() - start, 1)
    print(f"[gpu_check] {name}: rc={rc} in {seconds}s", flush=True)
    return {"cmd": cmd, "rc": rc, "seconds": seconds, "log": f"{name}.log"}


def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    steps: Dict[str, Dict[str, Any]] = {}
    summary: Dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "batchrules": batchrules.__file__, "built_for_torch": _build_info.TORCH_VERSION, "steps": steps,
    }

    tests = next((p for p in (Path.cwd() / "tests" / "test_cuda.py", PACKAGE_ROOT / "tests" / "test_cuda.py")
                  if p.is_file()), None)
    if not torch.cuda.is_available():
        print("[gpu_check] no CUDA device visible to torch", flush=True)
        summary["error"] = "no CUDA device"
    elif tests is None:
        steps["test_cuda"] = {"rc": "missing", "error": "tests/test_cuda.py not found"}
    else:
        xml = out_dir / "test_cuda.xml"
        step = steps["test_cuda"] = run_step(
            "test_cuda", [sys.executable, "-m", "pytest", str(tests), "-q", "-rs", "-p", "no:cacheprovider",
                          f"--junitxml={xml}"], out_dir)
        suite = ElementTree.parse(xml).getroot().find("testsuite") if xml.is_file() else None
        step["counts"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} \
            if suite is not None else {}
        if step["rc"] == 0 and step["counts"].get("skipped", 0):
            step["rc"] = "skipped tests"  # with a GPU visible a skip means CUDA went untested
    if torch.cuda.is_available():
        steps["bench"] = run_step(
            "bench", [sys.executable, "-m", "batchrules.bench", "--device", "cuda",
                      "--json", str(out_dir / "bench.json")], out_dir)
    summary["ok"] = ok = summary.get("error") is None and all(s["rc"] == 0 for s in steps.values())
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    return 0 if ok else 1
