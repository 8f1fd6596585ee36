"""DP-SGD rows: one step's clipped sums (parameter order) then the per-sample
norms (max_norm 1, cross-entropy per sample), checked against a float64
per-sample loop. Variants: stock / batchrules (vmap(grad) then clip and sum,
routing off / on); clipped_grad; opacus_hooks (GradSampleModule, then
DPOptimizer's clipping); opacus_ghost (``make_private(grad_sample_mode="ghost")``);
limit (hand-written book-keeping, MLP only); nonprivate (the summed gradients,
by autograd.grad) and nonprivate_grad (by torch.func's grad, compiled too).
Targets: clipped_grad <= 1.2x the non-private step where the step is large
enough for fixed costs not to dominate (compiled twins: <= 1.1x the compiled
non-private step, and faster than eager), >= 1.5x faster than ghost clipping,
>= 20x faster than stock at MLP batch 128, peak memory <= 1.3x the non-private step's.
"""
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

from ..baselines import hand_written
from ..baselines import opacus_variants as opacus
from ..baselines.opacus_variants import cross_entropy_sum
from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..models import MlpSpec, cross_entropy, detached_params, in_float64, mlp, small_cnn
from ..targets import PeakMemory, Speedup, Target
from .per_sample_grads import per_sample_loop

MAX_NORM = 1.0
# Smooth activations (SiLU, GELU): at a ReLU's kink, float32 rounding of a
# pre-activation near zero flips the mask, and that sample's gradient differs
# from the float64 reference by far more than rounding, which no tolerance
# tells from a bug.
MLP_SPEC = MlpSpec((784, 512, 512, 10), "silu")
# (batch, tier, modes)
MLP_BATCHES = ((8, "small", {"smoke"}), (32, "medium", {"quick", "full"}),
               (128, "large", {"headline", "quick", "full"}), (512, "large", {"full"}))
CNN_BATCHES = ((8, "small", {"smoke"}), (32, "medium", {"quick", "full"}), (128, "large", {"full"}))
# ((d_model, heads, feed-forward width, tokens per sample), batch, tier, modes): the
# fixed cost of a step weighs most on the smallest layer
ENCODER_CASES = (((64, 4, 128, 16), 8, "small", {"smoke"}),
                 ((64, 4, 128, 16), 32, "small", {"quick", "full"}),
                 ((128, 4, 512, 32), 32, "medium", {"quick", "full"}),
                 ((256, 8, 1024, 32), 32, "large", {"full"}))


class Encoder(nn.Module):
    """One transformer encoder layer over a sequence, mean-pooled, classified."""

    def __init__(self, d_model: int, heads: int, ff: int, classes: int = 10) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True,
                                                activation="gelu")
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


def clip_and_sum(per_sample: Dict[str, Tensor], max_norm: float) -> List[Tensor]:
    """The torch.func recipe after vmap(grad): norms over all parameters, scale, sum."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()], 1).norm(dim=1)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return [*(torch.einsum("b,b...->...", scale, g) for g in per_sample.values()), norms]


def loop_reference(model: nn.Module, x: Tensor, y: Tensor) -> List[Tensor]:
    """float64: one backward per sample, then clip and sum."""
    return clip_and_sum({str(k): g for k, g in enumerate(per_sample_loop(model, x, y))}, MAX_NORM)


def summed_reference(model: nn.Module, x: Tensor, y: Tensor) -> List[Tensor]:
    """float64 summed gradients: the non-private step's reference."""
    m64 = in_float64(model)
    return list(torch.autograd.grad(cross_entropy_sum(m64(x.cpu().double()), y.cpu()),
                                    list(m64.parameters())))


def clipped_grad_variant(clipped: Callable[..., Any], *args: Any) -> Variant:
    """A clipped_grad step on ``args``: the clipped sums (parameter order), then
    the norms; user code, with a compiled twin where twins run."""
    def step() -> List[Tensor]:
        sums, norms = clipped(*args)
        return [*sums.values(), norms]
    return Variant("clipped_grad", step, user_code=True)


def nonprivate_variants(summed_loss: Callable[[Dict[str, Tensor]], Tensor], params: Dict[str, Tensor],
                        model_loss: Callable[[], Tensor], trainable: Sequence[Tensor],
                        reference: Callable[[], Any]) -> List[Variant]:
    """The non-private step, the summed gradients, two ways: ``nonprivate``
    as eager code takes them (``autograd.grad`` of ``model_loss``, the model
    called on the batch: the eager targets' baseline), and ``nonprivate_grad``
    as torch.func does (``grad``, whose compiled twin is one graph as the DP
    step's is: the compiled targets' baseline; autograd.grad does not compile
    with fullgraph)."""
    summed_grad = grad(summed_loss)

    def eager() -> List[Tensor]:
        return list(torch.autograd.grad(model_loss(), trainable))

    def functional() -> List[Tensor]:
        return list(summed_grad(params).values())
    return [Variant("nonprivate", eager, reference=reference),
            Variant("nonprivate_grad", functional, user_code=True, reference=reference)]


def _dp_setup(model: nn.Module, x: Tensor, y: Tensor, limit: Optional[Callable[[], Any]] = None) -> CaseSetup:
    params, trainable = detached_params(model), list(model.parameters())

    def sample_loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def vmap_clip() -> List[Tensor]:
        return clip_and_sum(per_sample_grads(params, x, y), MAX_NORM)

    reference_of = functools.partial(loop_reference, x=x, y=y)

    def summed_loss(p: Dict[str, Tensor]) -> Tensor:
        return cross_entropy_sum(functional_call(model, p, (x,)), y)

    variants = [*stock_and_batchrules(vmap_clip),
                clipped_grad_variant(batchrules.clipped_grad(sample_loss, MAX_NORM), params, x, y),
                *nonprivate_variants(summed_loss, params, lambda: cross_entropy_sum(model(x), y), trainable,
                                     lambda: summed_reference(model, x, y)),
                *([Variant("limit", limit)] if limit is not None else [])]
    setup = CaseSetup(variants, reference=lambda: reference_of(model),
                      floor=vmap_identity((None, 0, 0), (params, x, y), returned=0))
    ghost_loss = nn.CrossEntropyLoss(reduction="sum")
    return opacus.with_opacus(setup, ["opacus_hooks", "opacus_ghost"], lambda: [
        opacus.opacus_clip_variant(model, x, y, cross_entropy_sum, MAX_NORM, reference_of),
        opacus.opacus_ghost_variant(model, x, y, ghost_loss, MAX_NORM, reference_of)])


NEAR_NONPRIVATE = Speedup("DP: clipped_grad <= 1.2x the non-private step (nonprivate / clipped_grad >= 0.83)",
                          "nonprivate", "clipped_grad", 1 / 1.2)
VS_GHOST = Speedup("DP: clipped_grad >= 1.5x faster than Opacus ghost clipping",
                   "opacus_ghost", "clipped_grad", 1.5)
VS_STOCK = Speedup("DP: clipped_grad >= 20x faster than vmap(grad)+clip (stock)",
                   "stock", "clipped_grad", 20.0)
# Compiled twins (--compiled, --full): the DP step in one graph with its update.
COMPILED_NEAR_NONPRIVATE = Speedup(
    "DP compiled: clipped_grad <= 1.1x the compiled non-private step "
    "(nonprivate_grad_compiled / clipped_grad_compiled >= 0.91)", "nonprivate_grad_compiled",
    "clipped_grad_compiled", 1 / 1.1)
COMPILED_FASTER = Speedup("DP compiled: faster than eager (clipped_grad / clipped_grad_compiled >= 1)",
                          "clipped_grad", "clipped_grad_compiled", 1.0)
PEAK_MEMORY = PeakMemory("DP: clipped_grad peak memory <= 1.3x the non-private step's "
                         "(nonprivate / clipped_grad >= 0.77)", "nonprivate", "clipped_grad", 1 / 1.3)


def _targets(near_nonprivate: bool, vs_stock: bool = False) -> Sequence[Target]:
    """Every DP row: vs ghost clipping and peak memory; the step-time target
    against the non-private step where asked (MLP batch >= 128, transformer)."""
    return [*([NEAR_NONPRIVATE, COMPILED_NEAR_NONPRIVATE] if near_nonprivate else []), COMPILED_FASTER,
            VS_GHOST, *([VS_STOCK] if vs_stock else []), PEAK_MEMORY]


def _mlp(batch: int, device: torch.device) -> CaseSetup:
    """With the limit: clipping by book-keeping."""
    model, x = mlp(MLP_SPEC).to(device), torch.randn(batch, MLP_SPEC.sizes[0], device=device)
    y = torch.randint(0, MLP_SPEC.sizes[-1], (batch,), device=device)
    params = detached_params(model)
    layers = MLP_SPEC.layers(params)

    def limit() -> List[Tensor]:
        sums, norms = hand_written.mlp_bookkeeping(layers, MLP_SPEC.act, x, y, MAX_NORM)
        return [*sums, norms]

    return _dp_setup(model, x, y, limit)


def _cnn(batch: int, device: torch.device) -> CaseSetup:
    return _dp_setup(small_cnn().to(device), torch.randn(batch, 1, 28, 28, device=device),
                     torch.randint(0, 10, (batch,), device=device))


def _encoder(config: Tuple[int, int, int, int], batch: int, device: torch.device) -> CaseSetup:
    d_model, heads, ff, tokens = config
    model = Encoder(d_model, heads, ff).to(device)
    return _dp_setup(model, torch.randn(batch, tokens, d_model, device=device),
                     torch.randint(0, 10, (batch,), device=device))


def cases(mode: str) -> List[Case]:
    """DP-SGD cases (MLP, CNN, transformer layer) for a mode."""
    return (
        [Case("dp_mlp", f"b{b}", t, MLP_SPEC.n_linears,
              f"DP-SGD clipping, MLP {MLP_SPEC.sizes} {MLP_SPEC.act}, cross-entropy, batch {b}",
              functools.partial(_mlp, b), _targets(b >= 128, vs_stock=b == 128))
         for b, t, m in MLP_BATCHES if mode in m]
        + [Case("dp_cnn", f"b{b}", t, 2, f"DP-SGD clipping, CNN conv5x16-conv5x32-fc64-fc10 on 28x28, "
                f"batch {b}", functools.partial(_cnn, b), _targets(False))
           for b, t, m in CNN_BATCHES if mode in m]
        + [Case("dp_transformer", f"d{c[0]}t{c[3]}_b{b}", t, 5,
                f"DP-SGD clipping, TransformerEncoderLayer(d={c[0]}, heads={c[1]}, ff={c[2]}, gelu) over "
                f"{c[3]} tokens + linear head, batch {b}", functools.partial(_encoder, c, b), _targets(True))
           for c, b, t, m in ENCODER_CASES if mode in m])
