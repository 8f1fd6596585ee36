"""One-shot GPU check of an already built batchrules: ``python -m batchrules.bench.gpu_check OUT_DIR``.

Builds nothing. Runs, each under its share of a wall-clock budget (default
280 s, so the whole check stays under 5 minutes):

1. ``pytest tests/test_cuda.py`` (values, gradcheck, vmap, per-sample grads,
   torch.compile on CUDA);
2. ``python -m batchrules.bench --device cuda`` (the headline rows; numbers
   also in ``bench.json``);
3. ``python -m batchrules.bench.compile_ops --device cuda --quick`` (extern vs
   decomposed ops under Inductor/Triton).

Writes ``<step>.log`` per step, ``test_cuda.xml`` (JUnit) and
``summary.json`` into OUT_DIR; exits 0 when every step that ran passed.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

import batchrules
from batchrules import _build_info

# Per-step caps in seconds; each step also gets no more than what is left.
CAPS = {"test_cuda": 100, "bench": 100, "compile_ops": 80}


def find_cuda_tests() -> Optional[Path]:
    """tests/test_cuda.py of the checkout: the working directory's, else next to the package."""
    for root in (Path.cwd(), Path(batchrules.__file__).resolve().parent.parent):
        candidate = root / "tests" / "test_cuda.py"
        if candidate.is_file():
            return candidate
    return None


def run_step(name: str, cmd: List[str], out_dir: Path, timeout_s: float) -> Dict[str, object]:
    """Run ``cmd`` with its output in ``out_dir/<name>.log``; never raises."""
    env = dict(os.environ)
    package_root = str(Path(batchrules.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    log_path = out_dir / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result: Dict[str, object] = {"cmd": cmd, "rc": rc, "seconds": round(time.monotonic() - start, 1),
                                 "log": log_path.name}
    print(f"[gpu_check] {name}: rc={rc} in {result['seconds']}s", flush=True)
    return result


def pytest_counts(log: str) -> Dict[str, int]:
    """Counts from pytest's final summary line ("3 passed, 1 skipped in ...")."""
    lines = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", lines[-1])
            if kind in ("passed", "failed", "skipped", "error", "errors", "xfailed")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for logs and summary.json")
    parser.add_argument("--budget-s", type=float, default=280.0, help="total wall-clock budget")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s

    summary: Dict[str, object] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "batchrules": batchrules.__file__, "built_for_torch": _build_info.TORCH_VERSION,
        "steps": {},
    }
    steps: Dict[str, Dict[str, object]] = summary["steps"]  # type: ignore[assignment]

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
            steps["test_cuda"] = run_step(
                "test_cuda", [sys.executable, "-m", "pytest", str(tests), "-q", "-rs",
                              "-p", "no:cacheprovider",
                              f"--junitxml={args.out_dir / 'test_cuda.xml'}"],
                args.out_dir, remaining("test_cuda"))
            counts = pytest_counts((args.out_dir / "test_cuda.log").read_text())
            steps["test_cuda"]["counts"] = counts
            if steps["test_cuda"]["rc"] == 0 and counts.get("skipped", 0):
                # With a GPU visible nothing may skip: a skip means CUDA went untested.
                steps["test_cuda"]["rc"] = "skipped tests"
        steps["bench"] = run_step(
            "bench", [sys.executable, "-m", "batchrules.bench", "--device", "cuda",
                      "--json", str(args.out_dir / "bench.json")],
            args.out_dir, remaining("bench"))
        steps["compile_ops"] = run_step(
            "compile_ops", [sys.executable, "-m", "batchrules.bench.compile_ops", "--device", "cuda",
                            "--quick", "--out", str(args.out_dir / "compile_ops.json")],
            args.out_dir, remaining("compile_ops"))

    ok = summary.get("error") is None and all(s["rc"] == 0 for s in steps.values())
    summary["ok"] = ok
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
