"""The bench's timing and checking method, on synthetic steps and results:
interleaved blocks, paired ratios, the noise verdict of the targets (speed,
the fastest of several baselines, compiled twins, the distributed job), the
reference check, the instruments (kernels, peak memory, compiled twins) and
how the tables mark wrong, failed and skipped variants."""
import platform

import pytest
import torch

from batchrules.bench import distributed
from batchrules.bench.case import Case, CaseSetup, Variant
from batchrules.bench.compiled import (
    check_no_recompile,
    compile_failure,
    compile_now,
    compiled_twin,
    fresh_function,
)
from batchrules.bench.kernels import count_kernels, eager_linear_kernels
from batchrules.bench.machine import steady_malloc
from batchrules.bench.memory import peak_extra_bytes
from batchrules.bench.report import all_correct, headline_table, table, targets_text
from batchrules.bench.runner import CaseResult, VariantResult, compare, run_case
from batchrules.bench.scenarios import all_cases
from batchrules.bench.scenarios.dp_bf16 import has_bf16_kernels
from batchrules.bench.targets import COMPILED_TARGET, FASTER_THAN_OPACUS, Speedup, evaluate, transform_targets
from batchrules.bench.timing import Stats, TimingPlan, paired_ratios, time_interleaved

CPU = torch.device("cpu")
TWINS = ("stock_compiled", "batchrules_compiled")
PLAN = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=2, max_repeats=2, warmup_calls=0)


def test_interleaving_rotates_the_order_and_warms_each_block() -> None:
    """Note [Why interleave]: each repeat times one block of every variant, in
    an order that rotates, each block after one untimed call of its own."""
    calls: list = []
    variants = [Variant(name, lambda name=name: calls.append(name)) for name in "abc"]
    plan = TimingPlan(block_s=0.0, budget_s=0.0, min_repeats=3, max_repeats=3, warmup_calls=0)
    stats = time_interleaved(variants, plan, lambda: None)
    assert {name: len(s.times) for name, s in stats.items()} == {"a": 3, "b": 3, "c": 3}
    assert "".join(calls) == "aabbcc" + "aabbcc" + "bbccaa" + "ccaabb"  # sizing, then 3 rounds


def test_paired_ratios_and_quantiles() -> None:
    a, b = Stats([2.0, 4.0, 6.0]), Stats([1.0, 2.0, 2.0])
    assert paired_ratios(a, b).times == [2.0, 2.0, 3.0]
    assert a.median == 4.0 and a.quantile(0.25) == 3.0 and a.iqr == 2.0


def test_reference_check_detects_wrong_results() -> None:
    ref = torch.randn(4, 5, dtype=torch.float64)
    assert compare(ref.float(), ref, rtol=1e-4).ok
    assert not compare(ref.float() + 1e-2, ref, rtol=1e-4).ok
    assert not compare(ref.float()[:3], ref, rtol=1e-4).ok
    assert not compare([ref.float()], [ref, ref], rtol=1e-4).ok


def test_variant_reference_replaces_the_case_reference() -> None:
    x = torch.randn(4, dtype=torch.float64)

    def build(device: torch.device) -> CaseSetup:
        return CaseSetup([Variant("same", lambda: x.float()),
                          Variant("own", lambda: 2 * x.float(), reference=lambda: 2 * x),
                          Variant("wrong", lambda: 2 * x.float())], reference=lambda: x)

    result = run_case(Case("unit", "s", "small", 0, "per-variant references", build), CPU, PLAN)
    assert [result.variants[n].check.ok for n in ("same", "own", "wrong")] == [True, True, False]
    assert all(len(v.stats.times) == 2 for v in result.variants.values())


def _result(times: dict, not_compiled: tuple = (), tier: str = "small") -> CaseResult:
    r = CaseResult(Case("ensemble_train", "tiny", tier, 2, "synthetic", build=lambda device: None))
    for name, ts in times.items():
        vr = r.variants[name] = VariantResult(name, stats=Stats(list(ts)), compiled=name in TWINS,
                                              compile_s=1.5 if name in TWINS else None)
        vr.check = compare(torch.ones(1), torch.ones(1, dtype=torch.float64), 1e-4)
    for name in not_compiled:
        r.variants[name] = VariantResult(name, compiled=True, not_compiled="did not compile: Boom: why")
    return r


def test_speed_verdicts_met_missed_and_noise() -> None:
    """A miss whose threshold lies within the paired ratios' spread is noise."""
    eager = {"stock": [4.0] * 5, "batchrules": [3.0] * 5, "limit": [1.0] * 5}
    faster = _result({**eager, "stock_compiled": [2.0] * 5, "batchrules_compiled": [1.8] * 5})
    (check,) = [c for c in evaluate([faster], 2) if c.target == COMPILED_TARGET]
    assert check.verdict == "met" and check.value == pytest.approx(2.0 / 1.8)
    for twin, verdict in (([3.0] * 5, "missed"), ([1.9, 2.1, 2.1, 2.2, 1.8], "noise")):
        r = _result({**eager, "stock_compiled": [2.0] * 5, "batchrules_compiled": twin})
        assert [c.verdict for c in evaluate([r], 2) if c.target == COMPILED_TARGET] == [verdict]
    broken = _result({**eager, "stock_compiled": [2.0] * 5}, not_compiled=("batchrules_compiled",))
    (check,) = evaluate([broken], 2)
    assert check.verdict == "missed" and "Boom" in check.detail and not all_correct([broken])
    neither = _result(eager, not_compiled=TWINS)  # stock torch.compile fails on the flow too
    assert evaluate([neither], 2) == [] and all_correct([neither])


def test_speedup_over_the_fastest_of_several_baselines_repeat_by_repeat() -> None:
    r = _result({"loop": [2.0, 4.0, 1.0], "limit": [3.0, 1.0, 4.0], "batchrules": [2.0] * 3})
    check = Speedup("best", ("loop", "limit"), "batchrules", 0.95).check(r, 2)
    assert check.value == pytest.approx(0.5) and check.verdict == "missed"  # per repeat: 1, 0.5, 0.5
    r.variants["limit"] = VariantResult("limit", skipped="why")
    assert Speedup("best", ("loop", "limit"), "batchrules", 0.95).check(r, 2).verdict == "skipped"


def test_case_targets_are_the_scenarios() -> None:
    r = _result({"stock": [4.0] * 5, "batchrules": [3.0] * 5, "limit": [2.0] * 5, "opacus": [9.0] * 5})
    assert evaluate([r], linear_floor=2) == []  # the synthetic case declares none
    r.case.targets = [*transform_targets("medium"), FASTER_THAN_OPACUS]
    assert {c.target: c.verdict for c in evaluate([r], linear_floor=2)} == {
        "not slower than stock (stock / batchrules >= 1)": "met",
        "within 1.1x of the limit (limit / batchrules >= 0.91)": "missed",
        "faster than Opacus (opacus / batchrules > 1)": "met",
    }


def test_distributed_time_target_is_the_median_of_paired_rounds() -> None:
    """Round by round dp/np is 1.2, 1.2, 1.5, 1.5, 1.5 while the rounds' speed
    drifts 3x: the median 1.5 misses, and 1.3 lies within the IQR: noise."""
    np_ = {"times_s": [0.010, 0.010, 0.020, 0.020, 0.030], "peak_bytes": 2**20}
    dp = {"times_s": [0.012, 0.012, 0.030, 0.030, 0.045], "peak_bytes": 2 * 2**20}
    rank = {"ddp": {"nonprivate": np_, "dp": np_}, "fsdp2": {"nonprivate": np_, "dp": dp}}
    lines = distributed.table([rank], distributed.SMOKE).splitlines()
    ddp, fsdp = (next(line for line in lines if line.startswith(w)) for w in ("ddp", "fsdp2"))
    assert "time <= 1.3x met" in ddp and "memory" not in ddp
    assert " 1.50 " in fsdp and "1.20-1.50" in fsdp and "time <= 1.3x noise" in fsdp
    assert "memory <= 1.3x MISSED" in fsdp


def test_tables_mark_skipped_wrong_and_failed_variants() -> None:
    r = _result({"stock": [4.0] * 3, "batchrules": [2.0] * 3, "limit": [1.0] * 3})
    r.variants["opacus"] = VariantResult("opacus", skipped="opacus not importable (no)")
    r.case.targets = [FASTER_THAN_OPACUS]
    (check,) = evaluate([r], linear_floor=2)
    assert check.verdict == "skipped" and check.detail == "opacus: opacus not importable (no)"
    assert "0/0 met, 1 skipped" in targets_text([check]) and all_correct([r])
    assert "skipped: opacus not importable (no)" in table([r])
    (line,) = headline_table([r], [check]).splitlines()[2:]
    assert line.split()[:7] == ["ensemble_train/tiny", "4.000s", "2.000s", "2.00x", "1.000s", "2.00", "-"]
    assert line.endswith("opacus skipped")
    r.variants["batchrules"].check = compare(torch.zeros(1), torch.ones(1, dtype=torch.float64), 1e-4)
    r.variants["limit"] = VariantResult("limit", error="RuntimeError: boom")
    (line,) = headline_table([r], []).splitlines()[2:]
    assert "2.000s!" in line and "ERROR" in line and not all_correct([r])
    twins = _result({"stock": [4.0] * 3, "batchrules": [3.0] * 3, "limit": [1.0] * 3,
                     "stock_compiled": [2.0] * 3, "batchrules_compiled": [1.6] * 3})
    header, _, *rows = table([twins]).splitlines()
    assert "vs s.comp" in header and "compile" in header
    twin_row = next(row for row in rows if "batchrules_compiled" in row)
    assert "1.25x" in twin_row and "1.5s" in twin_row and "1.60" in twin_row


@pytest.mark.parametrize("mode", ["smoke", "headline", "quick", "full"])
def test_every_case_declares_targets(mode: str) -> None:
    cases = all_cases(mode)
    assert len({c.name for c in cases}) == len(cases)
    # the bf16 row's target needs bf16 kernels
    untargeted = [c.name for c in cases if not c.targets]
    assert untargeted == ([] if has_bf16_kernels() or mode != "full" else ["dp_transformer_bf16/d256t32_b32"])


def test_headline_covers_every_workload_once() -> None:
    """Ensembles, per-sample gradients (with Opacus), a hypernetwork, the DP
    step and the DP engine's loop, the training-step ops (linear, SiLU/Mish,
    losses, attention)."""
    assert [c.name for c in all_cases("headline")] == [
        "ensemble_train/mbpo", "psg_mlp/b32", "hyper_fwd_bwd/medium", "eager_linear/medium",
        "psg_transformer/b8", "loss_grad/cross_entropy/b8", "loss_grad/mse/b8", "dp_mlp/b128",
        "dp_engine_mlp/b128", "eager_silu/medium", "eager_mish/medium"]


def test_kernel_counter_on_known_ops() -> None:
    x, w, b = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    assert eager_linear_kernels(CPU) == 2  # CPU addmm copies the bias into its output, then the GEMM
    assert count_kernels(Variant("clone", lambda: x.clone()), CPU).per_step == 1
    assert count_kernels(Variant("view", lambda: x.view(2, 64).t()), CPU).per_step == 0
    counts = count_kernels(Variant("linear", lambda: torch.nn.functional.linear(x, w, b)), CPU)
    assert (counts.linear_calls, counts.per_linear_forward) == (1, 2.0)
    bmm = Variant("bmm", lambda: torch.bmm(x.view(2, 4, 16), x.view(2, 16, 4)))
    assert count_kernels(bmm, CPU).per_step == 1


def test_peak_memory_counts_live_result() -> None:
    assert peak_extra_bytes(Variant("alloc", lambda: torch.empty(1 << 18)), CPU) >= 4 << 18


def test_peak_memory_leaves_out_frees_of_earlier_blocks() -> None:
    """Note [How peak memory is measured]: a block allocated under an earlier
    profile and freed by the step (a user's loop freeing the last step's
    gradients) does not lower the step's peak."""
    held: list = []
    peak_extra_bytes(Variant("keep", lambda: held.append(torch.empty(1 << 20))), CPU)

    def step() -> torch.Tensor:
        held.clear()
        return torch.empty(1 << 18)

    assert peak_extra_bytes(Variant("swap", step), CPU) >= 4 << 18


def test_steady_malloc_where_glibc() -> None:
    """Note [Steady malloc for timing]: mallopt succeeds wherever malloc is glibc's."""
    assert steady_malloc() is (platform.libc_ver()[0] == "glibc")


def test_fresh_function_has_its_own_code_object() -> None:
    box = [1]
    fn = lambda: box[0] + 1  # noqa: E731
    fresh = fresh_function(fn, "twin")
    assert fresh.__code__ is not fn.__code__ and fresh.__code__.co_name.endswith("twin")
    box[0] = 41
    assert fresh() == 42  # same closure cells
    with pytest.raises(TypeError, match="plain Python function"):
        fresh_function(torch.relu, "twin")


COMPUTE = {"aten.bmm.default", "aten.baddbmm.default", "aten.mul.Scalar", "aten.add.Tensor"}


def test_twins_are_separate_compilations_under_their_routing() -> None:
    """One step function, two twins: each keeps the routing it was compiled
    under (the routed graph is batchrules' batching rule, bmm + bias add as
    traced (Note [GEMM and bias apart when traced]); stock's is functorch's addmm
    decomposition, bmm, a scalar mul and the add)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    x, w, b = torch.randn(3, 5, 4), torch.randn(3, 6, 4), torch.randn(3, 6)
    batched = torch.func.vmap(torch.nn.functional.linear)

    def user_code() -> torch.Tensor:
        return batched(x, w, b)

    want = torch.stack([torch.nn.functional.linear(x[i], w[i], b[i]) for i in range(3)])
    ops = {}
    for routing in (False, True):
        recorder = AotEagerAndRecordGraphs()
        twin = compiled_twin(Variant("v", user_code, routing=routing, user_code=True), recorder)
        result, seconds = compile_now(twin, lambda: None)
        torch.testing.assert_close(result, want)
        assert seconds > 0
        check_no_recompile(twin)
        assert len(recorder.fw_graphs) == 1
        ops[routing] = [str(n.target) for n in recorder.fw_graphs[0].graph.nodes if n.op == "call_function"]
    assert [op for op in ops[True] if op in COMPUTE] == ["aten.bmm.default", "aten.add.Tensor"]
    assert [op for op in ops[False] if op in COMPUTE] == ["aten.bmm.default", "aten.mul.Scalar",
                                                          "aten.add.Tensor"]


def test_graph_break_is_a_one_line_compile_failure() -> None:
    x = torch.randn(3, requires_grad=True)

    def user_code() -> torch.Tensor:
        return torch.autograd.grad(x.square().sum(), x)[0]

    with pytest.raises(Exception) as info:
        compile_now(compiled_twin(Variant("v", user_code, user_code=True), "eager"), lambda: None)
    reason = compile_failure(info.value)
    assert reason.startswith("did not compile: ") and "\n" not in reason
