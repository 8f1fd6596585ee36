"""``python -m batchrules.bench --gpu-check OUT_DIR``: one check of an already
built batchrules on a GPU machine. Builds nothing; runs, each under its share of
a wall-clock budget, ``pytest tests/test_cuda.py`` (values, gradcheck, vmap,
per-sample grads, torch.compile on CUDA; a skip fails the step) and the headline
bench on cuda (its numbers in ``bench.json``). Writes ``<step>.log`` per step,
``test_cuda.xml`` and ``summary.json`` into OUT_DIR; returns 0 when every step passed.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

import batchrules
from batchrules import _build_info

# Per-step caps in seconds; each step also gets no more than what is left.
CAPS = {"test_cuda": 100, "bench": 100}
PACKAGE_ROOT = Path(batchrules.__file__).resolve().parent.parent


def find_cuda_tests() -> Optional[Path]:
    """tests/test_cuda.py of the checkout: the working directory's, else next to the package."""
    candidates = (root / "tests" / "test_cuda.py" for root in (Path.cwd(), PACKAGE_ROOT))
    return next((c for c in candidates if c.is_file()), None)


def run_step(name: str, cmd: List[str], out_dir: Path, timeout_s: float) -> Dict[str, Any]:
    """Runs ``cmd`` with its output in ``out_dir/<name>.log``; never raises."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    log_path = out_dir / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc: Any = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = round(time.monotonic() - start, 1)
    print(f"[gpu_check] {name}: rc={rc} in {seconds}s", flush=True)
    return {"cmd": cmd, "rc": rc, "seconds": seconds, "log": log_path.name}


def pytest_counts(log: str) -> Dict[str, int]:
    """Counts from pytest's final summary line ("3 passed, 1 skipped in ...")."""
    lines = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", lines[-1])
            if kind in ("passed", "failed", "skipped", "error", "errors", "xfailed")}


def main(out_dir: Path, budget_s: float = sum(CAPS.values())) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    steps: Dict[str, Dict[str, Any]] = {}
    summary: Dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "batchrules": batchrules.__file__, "built_for_torch": _build_info.TORCH_VERSION,
        "steps": steps,
    }

    def remaining(name: str) -> float:
        return max(1.0, min(CAPS[name], deadline - time.monotonic()))

    if not torch.cuda.is_available():
        print("[gpu_check] no CUDA device visible to torch", flush=True)
        summary["error"] = "no CUDA device"
    else:
        tests = find_cuda_tests()
        if tests is None:
            steps["test_cuda"] = {"rc": "missing", "error": "tests/test_cuda.py not found"}
        else:
            step = steps["test_cuda"] = run_step(
                "test_cuda", [sys.executable, "-m", "pytest", str(tests), "-q", "-rs",
                              "-p", "no:cacheprovider", f"--junitxml={out_dir / 'test_cuda.xml'}"],
                out_dir, remaining("test_cuda"))
            step["counts"] = pytest_counts((out_dir / "test_cuda.log").read_text())
            if step["rc"] == 0 and step["counts"].get("skipped", 0):
                step["rc"] = "skipped tests"  # with a GPU visible a skip means CUDA went untested
        steps["bench"] = run_step(
            "bench", [sys.executable, "-m", "batchrules.bench", "--device", "cuda",
                      "--json", str(out_dir / "bench.json")], out_dir, remaining("bench"))

    summary["ok"] = ok = summary.get("error") is None and all(s["rc"] == 0 for s in steps.values())
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    return 0 if ok else 1
