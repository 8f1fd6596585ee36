"""How should Inductor see batchrules.linear? Measures the two choices.

``python -m batchrules.bench.compile_ops [--device cuda] [--quick] [--out FILE.json]``

Times one training step (forward + backward) of a 3-layer ReLU MLP of
``batchrules.linear`` per (batch, width), for: eager; ``torch.compile`` with the
ops as extern kernels; ``torch.compile`` with them decomposed to aten (the
default, see ``batchrules.compile``); and ``torch.compile`` of the same
MLP with ``F.linear`` as the reference. Compile caches are disabled so each
variant really compiles with its own setting.
"""
import argparse
import json
import statistics
import time
import types
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import batchrules
from batchrules import compile as compile_hooks


def mlp(linear: Callable[..., Tensor]) -> Callable[[Tensor, List[Tensor], List[Tensor]], Tensor]:
    def loss(x: Tensor, weights: List[Tensor], biases: List[Tensor]) -> Tensor:
        h = x
        for i, (w, b) in enumerate(zip(weights, biases)):
            h = linear(h, w, b)
            if i < len(weights) - 1:
                h = torch.relu(h)
        return h.square().mean()

    # A fresh code object per variant: Dynamo caches compiled code per code object.
    code = loss.__code__.replace(co_name=f"mlp_{id(linear)}")
    return types.FunctionType(code, loss.__globals__, code.co_name, None, loss.__closure__)


def train_step(loss_fn: Callable[..., Tensor]) -> Callable[..., None]:
    def step(x: Tensor, weights: List[Tensor], biases: List[Tensor]) -> None:
        for p in weights + biases:
            p.grad = None
        loss_fn(x, weights, biases).backward()

    return step


def make_inputs(batch: int, width: int, device: str) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    x = torch.randn(batch, width, device=device)
    weights = [(torch.randn(width, width, device=device) * width**-0.5).requires_grad_()
               for _ in range(3)]
    biases = [torch.zeros(width, device=device, requires_grad=True) for _ in range(3)]
    return x, weights, biases


def median_ms(step: Callable[..., None], args: tuple, device: str, reps: int) -> float:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        step(*args)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        step(*args)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compiled_step(linear: Callable[..., Tensor], decompose: bool, args: tuple) -> Callable:
    """Compile (and run once, compiling the backward too) with decompositions on/off."""
    step = train_step(torch.compile(mlp(linear), fullgraph=True, dynamic=False))
    was_registered = compile_hooks.decompositions_registered()
    (compile_hooks.register_decompositions if decompose
     else compile_hooks.unregister_decompositions)()
    try:
        with torch._inductor.config.patch(force_disable_caches=True), \
                torch._functorch.config.patch(enable_autograd_cache=False), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*force disabled by")
            step(*args)
    finally:
        (compile_hooks.register_decompositions if was_registered
         else compile_hooks.unregister_decompositions)()
    return step


def run(device: str, sizes: Sequence[Tuple[int, int]], reps: int,
        out: Optional[str]) -> List[Dict[str, object]]:
    """Measure every size; after each, print its row and rewrite ``out`` (so a
    run stopped by a timeout keeps what it measured)."""
    rows: List[Dict[str, object]] = []
    for batch, width in sizes:
        args = make_inputs(batch, width, device)
        steps = {
            "eager": train_step(mlp(batchrules.linear)),
            "extern": compiled_step(batchrules.linear, False, args),
            "decomposed": compiled_step(batchrules.linear, True, args),
            "F.linear": compiled_step(F.linear, True, args),
        }
        row: Dict[str, object] = {"batch": batch, "width": width}
        # Interleave rounds so a noisy machine affects all variants alike.
        samples: Dict[str, List[float]] = {name: [] for name in steps}
        for _ in range(3):
            for name, step in steps.items():
                samples[name].append(median_ms(step, args, device, reps))
        row.update({name: min(ms) for name, ms in samples.items()})
        rows.append(row)
        print(f"{batch:6d} x {width:5d}  " + "  ".join(
            f"{name}={row[name]:.3f}ms" for name in steps), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="two sizes, fewer repetitions")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        sizes = [(256, 1024), (4096, 4096)] if args.quick else [
            (64, 256), (256, 1024), (1024, 2048), (4096, 4096)]
    else:
        sizes = [(64, 256), (256, 512)] if args.quick else [
            (16, 64), (64, 256), (256, 512), (512, 1024)]
    torch.manual_seed(0)
    print(f"train step of a 3-layer MLP, median ms, device={args.device}, "
          f"torch {torch.__version__}", flush=True)
    run(args.device, sizes, reps=10 if args.quick else 15, out=args.out)


if __name__ == "__main__":
    main()
