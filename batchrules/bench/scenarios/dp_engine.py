"""DP-SGD in the user's own loop: ``zero_grad(); criterion(model(x), y).backward();
step()``, the same loop three ways: with batchrules' engine (``PrivateModule`` +
``DPOptimizer``, noise 0), without DP (``nonprivate``), and with Opacus'
make_private modules (``opacus_hooks``: GradSampleModule and DPOptimizer's
clipping; ``opacus_ghost``: ghost clipping's two backwards). ``engine_first``
is the engine's first step, a fresh wrapper with the first-step validation;
``engine_noised`` the engine's step with noise (noise multiplier 1), as
DP-SGD runs it (the other variants time the clipping without the noise).
Models: the MLP of ``dp_step`` and transformers GPT-2, BERT (a standard 2-D
``attention_mask``, right padding) and a peft LoRA on GPT-2, from configs.
Every loop uses SGD with lr 0 (the parameters stay as built), and returns the
gradient it applied (clipped sums: ``loss_reduction="sum"``) and the norms.
Targets: the engine <= 1.15x the non-private loop, >= 1.5x faster than Opacus
(ghost, or hooks where ghost cannot run the model: GPT-2's tied embeddings),
peak memory <= 1.2x the non-private loop's, and the first step (validation included) <= 2 steps.
Compiled twins (``--compiled``): the same loops with the model compiled
(``torch.compile(private, fullgraph=True)``, and the plain model for
``nonprivate``): <= 1.1x the compiled non-private loop, faster than eager.
"""
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ...dp.engine import DPOptimizer, PrivateModule
from ...dp.engine.noise import gaussian_noise
from ..baselines.opacus_variants import opacus_clip_variant, with_opacus
from ..case import Case, CaseSetup, Variant
from ..models import mlp
from ..targets import PeakMemory, Speedup, Target
from .dp_step import MAX_NORM, MLP_SPEC
from .dp_third_party import (
    LM_SIZES,
    Logits,
    Problem,
    Size,
    _ghost,
    _loop_reference,
    _summed_reference,
    bert_problem,
    gpt2_problem,
    guarded,
)

VARIANTS = ("engine", "engine_first", "engine_noised", "nonprivate", "opacus_hooks", "opacus_ghost")
NOISE_MULTIPLIER = 1.0  # engine_noised's


def _engine(model: nn.Module, validate: bool, noise_multiplier: float = 0.0,
            generator: Optional[torch.Generator] = None
            ) -> Tuple[PrivateModule, DPOptimizer, List[nn.Parameter]]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    private = PrivateModule(model, loss_reduction="sum", validate=validate)
    optimizer = DPOptimizer(torch.optim.SGD(trainable, lr=0.0), module=private,
                            noise_multiplier=noise_multiplier, max_grad_norm=MAX_NORM,
                            expected_batch_size=None, loss_reduction="sum", generator=generator)
    return private, optimizer, trainable


def _user_step(forward: Callable[..., Any], optimizer: Any, xs: Tuple[Tensor, ...], y: Tensor,
               criterion: nn.Module, params: List[nn.Parameter]) -> List[Any]:
    """The user's loop body; the gradients the optimizer applied."""
    optimizer.zero_grad()
    criterion(forward(xs), y).backward()
    optimizer.step()
    return [p.grad for p in params]


def engine_variants(model: nn.Module, xs: Tuple[Tensor, ...], y: Tensor, criterion: nn.Module,
                    grads_reference: Callable[[], List[Tensor]]) -> List[Variant]:
    """The engine's step in the user's loop, its first step (a fresh wrapper),
    and the step with the wrapper compiled (its twin: the norms stay in the
    compiled backward, so it returns the gradients only)."""
    private, optimizer, trainable = _engine(model, validate=False)

    def compiled(backend: Any) -> Variant:
        twin, twin_optimizer, params = _engine(model, validate=False)
        forward = torch.compile(twin, fullgraph=True, backend=backend)
        return Variant("engine_compiled",
                       lambda: _user_step(forward, twin_optimizer, xs, y, criterion, params),
                       reference=grads_reference)

    def step() -> List[Any]:
        grads = _user_step(private, optimizer, xs, y, criterion, trainable)
        assert private.per_sample_norms is not None
        return [*grads, private.per_sample_norms]

    def first_step() -> List[Any]:
        fresh, first, params = _engine(model, validate=True)
        grads = _user_step(fresh, first, xs, y, criterion, params)
        assert fresh.per_sample_norms is not None
        return [*grads, fresh.per_sample_norms]

    return [Variant("engine", step, compiled=compiled), Variant("engine_first", first_step)]


def noised_variant(model: nn.Module, xs: Tuple[Tensor, ...], y: Tensor, criterion: nn.Module,
                   reference_of: Callable[[], List[Tensor]]) -> Variant:
    """The engine's step as DP-SGD runs it, with noise (``NOISE_MULTIPLIER``)
    from a generator seeded alike every step, so that the reference draws the
    same noise: one ``gaussian_noise`` per parameter, in the optimizer's order."""
    generator = torch.Generator()
    private, optimizer, trainable = _engine(model, False, NOISE_MULTIPLIER, generator)

    def step() -> List[Any]:
        generator.manual_seed(0)
        grads = _user_step(private, optimizer, xs, y, criterion, trainable)
        assert private.per_sample_norms is not None
        return [*grads, private.per_sample_norms]

    def reference() -> List[Tensor]:
        draws = torch.Generator().manual_seed(0)
        *clean, norms = reference_of()
        noise = [gaussian_noise(p.detach(), NOISE_MULTIPLIER * MAX_NORM, draws) for p in trainable]
        return [*(g + n.to(g) for g, n in zip(clean, noise)), norms]

    return Variant("engine_noised", step, reference=reference)


def nonprivate_variant(model: nn.Module, xs: Tuple[Tensor, ...], y: Tensor,
                       criterion: nn.Module) -> Variant:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.0)

    def compiled(backend: Any) -> Variant:
        forward = torch.compile(model, fullgraph=True, backend=backend)
        return Variant("nonprivate_compiled",
                       lambda: _user_step(forward, optimizer, xs, y, criterion, trainable))

    return Variant("nonprivate", lambda: _user_step(model, optimizer, xs, y, criterion, trainable),
                   compiled=compiled, reference=lambda: _summed_reference(model, xs, y, criterion))


def engine_setup(problem: Problem) -> CaseSetup:
    model, xs, y, criterion = problem

    def reference_of(m: nn.Module) -> List[Tensor]:
        return _loop_reference(m, xs, y, criterion)

    setup = CaseSetup([*engine_variants(model, xs, y, criterion,
                                        lambda: reference_of(model)[:-1]),
                       noised_variant(model, xs, y, criterion, lambda: reference_of(model)),
                       nonprivate_variant(model, xs, y, criterion)],
                      reference=lambda: reference_of(model))
    return with_opacus(setup, ["opacus_hooks", "opacus_ghost"], lambda: [
        opacus_clip_variant(model, xs, y, lambda out, t: criterion(out, t), MAX_NORM, reference_of),
        *_ghost(model, xs, y, criterion, reference_of, setup)])


def _mlp_problem(batch: int, device: torch.device) -> Problem:
    torch.manual_seed(0)
    model = Logits(mlp(MLP_SPEC), _call).to(device)
    x = torch.randn(batch, MLP_SPEC.sizes[0], device=device)
    y = torch.randint(0, MLP_SPEC.sizes[-1], (batch,), device=device)
    return Problem(model, (x,), y, nn.CrossEntropyLoss(reduction="sum"))


def _call(model: nn.Module, x: Tensor) -> Tensor:
    return model(x)


def _bert_2d(size: Size, device: torch.device) -> Problem:
    """``bert_problem`` with the standard 2-D 0/1 attention_mask."""
    problem = bert_problem(size, device)
    ids, additive = problem.inputs
    return problem._replace(inputs=(ids, (additive.view(len(ids), -1) == 0).long()))


def _guarded(problem: Callable[[torch.device], Problem]) -> Callable[[torch.device], CaseSetup]:
    return guarded(problem, engine_setup, VARIANTS)


def targets(near_nonprivate: bool, opacus: str = "opacus_ghost") -> Sequence[Target]:
    """``opacus``: the Opacus variant that runs the model (ghost cannot tie parameters)."""
    return [*([Speedup("DP engine: <= 1.15x the non-private loop (nonprivate / engine >= 0.87)",
                       "nonprivate", "engine", 1 / 1.15)] if near_nonprivate else []),
            Speedup(f"DP engine: >= 1.5x faster than Opacus' make_private ({opacus})", opacus,
                    "engine", 1.5),
            PeakMemory("DP engine: peak memory <= 1.2x the non-private loop's (nonprivate / engine "
                       ">= 0.83)", "nonprivate", "engine", 1 / 1.2),
            Speedup("DP engine: first step, validation included, <= 2 steps (engine / engine_first "
                    ">= 0.5)", "engine", "engine_first", 0.5),
            # compiled twins (--compiled, --full): the model compiled in the same loop
            *([Speedup("DP engine compiled: <= 1.1x the compiled non-private loop "
                       "(nonprivate_compiled / engine_compiled >= 0.91)", "nonprivate_compiled",
                       "engine_compiled", 1 / 1.1)] if near_nonprivate else []),
            Speedup("DP engine compiled: faster than eager (engine / engine_compiled >= 1)", "engine",
                    "engine_compiled", 1.0)]


def cases(mode: str) -> List[Case]:
    """The MLP row in every mode but smoke's smallest; GPT-2 at batch 16 from
    --quick; BERT, LoRA and batch 64 with --full."""
    mlp_batch = 16 if mode == "smoke" else 128
    rows = [Case("dp_engine_mlp", f"b{mlp_batch}", "medium", MLP_SPEC.n_linears,
                 "DP-SGD in the user's loop, MLP 784-512-512-10 SiLU",
                 _guarded(functools.partial(_mlp_problem, mlp_batch)), targets(mlp_batch >= 128))]
    if mode not in ("quick", "full"):
        return rows
    sizes = LM_SIZES if mode == "full" else LM_SIZES[:1]
    for size in sizes:
        t = f"{size.layers} layers, d={size.d}, {size.tokens} tokens, batch {size.batch}"
        rows.append(Case("dp_engine_gpt2", size.name, "large", 4 * size.layers + 1,
                         f"DP-SGD in the user's loop, transformers GPT-2 (tied wte), {t}",
                         _guarded(functools.partial(gpt2_problem, size)),
                         targets(True, "opacus_hooks")))
        if mode == "full":
            rows += [
                Case("dp_engine_bert", size.name, "large", 6 * size.layers + 2,
                     f"DP-SGD in the user's loop, transformers BERT, 2-D attention_mask, {t}",
                     _guarded(functools.partial(_bert_2d, size)), targets(True)),
                Case("dp_engine_lora", size.name, "large", 2 * size.layers,
                     f"DP-SGD in the user's loop, peft LoRA r=8 on GPT-2 c_attn, {t}",
                     _guarded(functools.partial(gpt2_problem, size, lora=True)),
                     targets(True))]
    return rows
