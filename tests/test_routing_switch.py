"""The routing switch: its API, what runs under each transform and in eager
mode, exact restoration, silence, threads and the BATCHRULES_ENABLE variable."""
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from routing_transforms import REVERSE_MODE, X, transforms
from torch import Tensor, nn
from torch.func import grad, vmap

import batchrules
from batchrules.examples.inspect_routing import batchrules_op_counts

# Where the imported batchrules lives (checkout or site-packages): subprocesses
# run there so that they import the same build.
PACKAGE_PARENT = Path(batchrules.__file__).resolve().parents[1]
ROUTED_KERNEL_SOURCE = "routing.cpp"  # the __FILE__ the dispatcher dump names


def linear_kernels() -> str:
    """The dispatcher's registrations for aten::linear, inactive (overridden) ones included."""
    return torch._C._dispatch_dump("aten::linear")


with batchrules.enabled(False):
    STOCK_KERNELS = linear_kernels()


def run_python(code: str, env_updates: Optional[Dict[str, Optional[str]]] = None,
               warnings_as_errors: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports the batchrules under test."""
    path = os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("BATCHRULES_ENABLE", None)
    for key, value in (env_updates or {}).items():
        if value is not None:
            env[key] = value
    flags = ["-W", "error"] if warnings_as_errors else []
    return subprocess.run([sys.executable, *flags, "-c", code], env=env, cwd=PACKAGE_PARENT,
                          capture_output=True, text=True, timeout=120)


# --- API ------------------------------------------------------------------------------------


def test_enable_disable_roundtrip(routing_off: None) -> None:
    assert not batchrules.is_enabled()
    for _ in range(3):  # idempotent: one registration however often it is enabled
        batchrules.enable()
    assert batchrules.is_enabled()
    routed = linear_kernels()
    assert routed.count(ROUTED_KERNEL_SOURCE) == 1
    assert "FuncTorchDynamicLayerFrontMode (inactive)" in routed  # functorch's linear_hack
    for _ in range(3):
        batchrules.disable()
    assert not batchrules.is_enabled()
    assert linear_kernels() == STOCK_KERNELS


def test_enabled_context_nests_and_restores(routing_off: None) -> None:
    with batchrules.enabled():
        assert batchrules.is_enabled()
        with batchrules.enabled(False):
            assert not batchrules.is_enabled()
            with batchrules.enabled(True):
                assert batchrules.is_enabled()
            assert not batchrules.is_enabled()
        assert batchrules.is_enabled()
    assert not batchrules.is_enabled()
    assert linear_kernels() == STOCK_KERNELS


def test_enabled_context_restores_on_exception(routing_on: None) -> None:
    with pytest.raises(KeyError):
        with batchrules.enabled(False):
            raise KeyError("boom")
    assert batchrules.is_enabled()
    with pytest.raises(ValueError):
        with batchrules.enabled(True):
            with batchrules.enabled(False):
                raise ValueError("boom")
    assert batchrules.is_enabled()


def test_enabled_rejects_non_bool() -> None:
    with pytest.raises(TypeError, match="expects a bool"):
        with batchrules.enabled(1):  # type: ignore[arg-type]
            pass


# --- What runs under each transform ----------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


MODEL = mlp()
PARAMS = {k: p.detach() for k, p in MODEL.named_parameters()}
TRANSFORMS = transforms(MODEL)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_runs_batchrules_linear(name: str, no_vmap_fallback: None) -> None:
    call = TRANSFORMS[name]
    with batchrules.enabled(True):
        routed_counts = batchrules_op_counts(call)
        routed = call()
    with batchrules.enabled(False):
        stock_counts = batchrules_op_counts(call)
        stock = call()
    assert routed_counts.get("batchrules::linear", 0) >= 2, routed_counts  # both layers
    if name in REVERSE_MODE:
        assert routed_counts.get("batchrules::linear_backward", 0) >= 2, routed_counts
        assert routed_counts.get("BatchrulesLinearBackward0", 0) >= 2, routed_counts
    assert stock_counts == {}
    torch.testing.assert_close(routed, stock)


# User code that views a linear's result, as attention projections do
# (q_proj(x).view(T, H, D)); eager F.linear returns a contiguous tensor.
VIEW_AFTER_LINEAR: Dict[str, tuple] = {
    "ensemble_shared_input": ((None, 0, 0), (torch.randn(6, 8), torch.randn(3, 8, 8),
                                              torch.randn(3, 8))),
    "per_model_input": ((0, 0, 0), (torch.randn(3, 6, 8), torch.randn(3, 8, 8),
                                    torch.randn(3, 8))),
    "batch_dim_in_the_middle": ((1, None, None), (torch.randn(6, 3, 8), torch.randn(8, 8),
                                                  torch.randn(8))),
    "batch_dim_last": ((2, None, None), (torch.randn(6, 8, 3), torch.randn(8, 8),
                                         torch.randn(8))),
}


@pytest.mark.parametrize("case", list(VIEW_AFTER_LINEAR))
def test_view_after_linear_works_as_stock(case: str, no_vmap_fallback: None) -> None:
    in_dims, args = VIEW_AFTER_LINEAR[case]

    def heads(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return F.linear(x, w, b).view(6, 2, 4).transpose(0, 1)

    fn = vmap(heads, in_dims)
    with batchrules.enabled(False):
        stock = fn(*args)
    with batchrules.enabled(True):
        routed = fn(*args)
        assert batchrules_op_counts(lambda: fn(*args)).get("batchrules::linear", 0) >= 1
        assert vmap(lambda *a: F.linear(*a), in_dims)(*args).is_contiguous()
    torch.testing.assert_close(routed, stock)


def test_grad_fn_is_batchrules_node_under_grad(routing_on: None) -> None:
    names: List[str] = []

    def loss(x: Tensor) -> Tensor:
        y = MODEL[0](x)
        names.append(torch._C._functorch.get_unwrapped(y).grad_fn.name())
        return y.sum()

    grad(loss)(X[0])
    assert names == ["BatchrulesLinearBackward0"]


# --- Eager code and disabling -----------------------------------------------------------------


def test_eager_path_unchanged_while_enabled() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    layer = nn.Linear(3, 2)

    def forward_backward() -> List[Tensor]:
        y = layer(x)
        y.sum().backward()
        return [y.detach(), x.grad.clone(), y.grad_fn.name()]

    with batchrules.enabled(False):
        stock = forward_backward()
        x.grad = None
    with batchrules.enabled(True):
        assert batchrules_op_counts(forward_backward) == {}
        x.grad = None
        routed = forward_backward()
    assert routed[2] == stock[2] == "AddmmBackward0"
    assert torch.equal(routed[0], stock[0]) and torch.equal(routed[1], stock[1])


def test_disable_restores_stock_decomposition(no_vmap_fallback: None) -> None:
    with batchrules.enabled(False):
        batchrules.enable()
        batchrules.disable()
        assert linear_kernels() == STOCK_KERNELS
        with torch.profiler.profile() as prof:
            vmap(F.linear, in_dims=(0, None, None))(X, PARAMS["0.weight"], PARAMS["0.bias"])
    names = {e.name for e in prof.events()}
    assert not any("batchrules" in n for n in names), names
    assert "aten::linear" in names and names & {"aten::addmm", "aten::matmul", "aten::mm"}, names


# --- Silence, threads, environment ------------------------------------------------------------


# The dispatcher's override warning is TORCH_WARN_ONCE, and torch 2.14 already spends it
# while `import torch` registers its own kernels: warn_always makes it fire on every release.
WARN_ALWAYS = "import torch\ntorch.set_warn_always(True)\n"


def test_enable_prints_nothing_even_with_warnings_as_errors() -> None:
    code = WARN_ALWAYS + (
        "import torch, batchrules\n"
        "from torch.func import vmap\n"
        "for _ in range(3): batchrules.enable()\n"
        "batchrules.disable(); batchrules.enable()\n"
        "with batchrules.enabled(False):\n"
        "    with batchrules.enabled(): pass\n"
        "vmap(torch.nn.Linear(3, 2))(torch.randn(4, 3))\n"
        "print('ok')\n"  # and exits with routing still on
    )
    result = run_python(code)
    assert (result.returncode, result.stdout, result.stderr) == (0, "ok\n", "")


def test_harness_sees_the_dispatcher_override_warning() -> None:
    # Overriding linear_hack without silencing the dispatcher does warn, so the
    # test above would catch that warning escaping from enable().
    code = WARN_ALWAYS + (
        "lib = torch.library.Library('aten', 'IMPL')\n"
        "lib.impl('linear', lambda x, w, b=None: x, 'FuncTorchDynamicLayerFrontMode')\n"
    )
    result = run_python(code, warnings_as_errors=False)
    assert "Overriding a previously registered kernel" in result.stderr


def test_concurrent_switching_from_threads(routing_off: None) -> None:
    errors: List[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                choice = rng.randrange(3)
                if choice == 0:
                    batchrules.enable()
                elif choice == 1:
                    batchrules.disable()
                else:
                    with batchrules.enabled(rng.random() < 0.5):
                        batchrules.is_enabled()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    kernels = linear_kernels()
    assert kernels.count(ROUTED_KERNEL_SOURCE) == int(batchrules.is_enabled())
    batchrules.disable()
    assert linear_kernels() == STOCK_KERNELS


def test_transforms_in_threads_while_enable_is_called_again(routing_on: None) -> None:
    weight = torch.randn(6, 4, 3, dtype=torch.float64)
    x = torch.randn(6, 3, dtype=torch.float64)
    expected = torch.einsum("boi,bi->bo", weight, x)
    errors: List[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(50):
                batchrules.enable()  # already on: must not disturb running transforms
                torch.testing.assert_close(vmap(F.linear)(x, weight), expected)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# slow: a fresh interpreter per value (the variable is read once, at import).
@pytest.mark.slow
@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("ON", True),
                                             ("0", False), ("", False), (None, False)])
def test_env_var_turns_routing_on_at_import(value: Optional[str], expected: bool) -> None:
    code = (
        "import torch, batchrules\n"
        "kernels = torch._C._dispatch_dump('aten::linear')\n"
        f"print(batchrules.is_enabled(), kernels.count({ROUTED_KERNEL_SOURCE!r}))\n"
    )
    result = run_python(code, {"BATCHRULES_ENABLE": value})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.split() == [str(expected), str(int(expected))]


def test_env_var_rejects_unknown_value() -> None:
    result = run_python("import batchrules", {"BATCHRULES_ENABLE": "maybe"})
    assert result.returncode != 0
    assert "ValueError: BATCHRULES_ENABLE='maybe' is not understood" in result.stderr
