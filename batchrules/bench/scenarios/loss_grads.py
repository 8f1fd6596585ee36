"""The losses alone: per-sample ``vmap(grad(loss))`` on one example made a batch
of one. Variants: stock (functorch's decompositions), batchrules (the rules of
csrc/losses/), composed (the loss written as its composition, e.g. log_softmax +
gather, under the same transforms) and hand_written (the per-sample gradient in
closed form). No transform reaches closed-form speed, so none is the "limit" and
the one target is against stock.
"""
from typing import Callable, FrozenSet, List, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, vmap

from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..targets import NOT_SLOWER

BATCH = 8
CLASSES = 10
SMOOTHING = 0.1
BETA = 1.0  # smooth_l1's beta, huber's delta


def _one(loss: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss of one example made a batch of one, as per-sample code calls it."""
    return lambda x, t: loss(x.unsqueeze(0), t.unsqueeze(0))


def _ce_composed(x: Tensor, t: Tensor) -> Tensor:
    return -F.log_softmax(x, -1).gather(-1, t.unsqueeze(-1)).mean()


def _ce_smoothing_composed(x: Tensor, t: Tensor) -> Tensor:
    logp = F.log_softmax(x, -1)
    nll = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    return ((1 - SMOOTHING) * nll - SMOOTHING / CLASSES * logp.sum(-1)).mean()


def _onehot(t: Tensor, like: Tensor) -> Tensor:
    return F.one_hot(t, like.shape[-1]).to(like.dtype)


def _huber_composed(x: Tensor, t: Tensor) -> Tensor:
    d = (x - t).abs()
    return torch.where(d < BETA, 0.5 * d * d, BETA * (d - 0.5 * BETA)).mean()


class LossSpec(NamedTuple):
    name: str
    loss: Callable[[Tensor, Tensor], Tensor]         # F.* on [1, ...] batches
    composed: Callable[[Tensor, Tensor], Tensor]     # the same loss by hand
    hand_written: Callable[[Tensor, Tensor], Tensor]  # d loss / d x for all [B, ...] at once
    classes: bool                                     # class-index targets
    modes: FrozenSet[str]


SPECS = (
    LossSpec("cross_entropy", F.cross_entropy, _ce_composed,
             lambda x, t: x.softmax(-1) - _onehot(t, x), True,
             frozenset({"smoke", "headline", "quick", "full"})),
    LossSpec("cross_entropy_smoothing", lambda x, t: F.cross_entropy(x, t, label_smoothing=SMOOTHING),
             _ce_smoothing_composed,
             lambda x, t: x.softmax(-1) - (1 - SMOOTHING) * _onehot(t, x) - SMOOTHING / CLASSES,
             True, frozenset({"full"})),
    LossSpec("nll", F.nll_loss, lambda x, t: -x.gather(-1, t.unsqueeze(-1)).mean(),
             lambda x, t: -_onehot(t, x), True, frozenset({"full"})),
    LossSpec("mse", F.mse_loss, lambda x, t: ((x - t) ** 2).mean(),
             lambda x, t: 2 * (x - t) / x.shape[-1], False, frozenset({"headline", "quick", "full"})),
    LossSpec("smooth_l1", F.smooth_l1_loss, lambda x, t: _huber_composed(x, t) / BETA,
             lambda x, t: (x - t).clamp(-BETA, BETA) / BETA / x.shape[-1], False,
             frozenset({"full"})),
    LossSpec("huber", F.huber_loss, _huber_composed,
             lambda x, t: (x - t).clamp(-BETA, BETA) / x.shape[-1], False, frozenset({"full"})),
)


def _case(spec: LossSpec) -> Case:
    def build(device: torch.device) -> CaseSetup:
        x = torch.randn(BATCH, CLASSES, device=device)
        t = (torch.randint(0, CLASSES, (BATCH,), device=device) if spec.classes
             else torch.randn(BATCH, CLASSES, device=device))
        stock = vmap(grad(_one(spec.loss)))
        composed = vmap(grad(_one(spec.composed)))

        def reference() -> Tensor:
            x64, t64 = x.cpu().double(), t.cpu() if spec.classes else t.cpu().double()
            rows = []
            for i in range(BATCH):
                xi = x64[i].requires_grad_(True)
                rows.append(torch.autograd.grad(_one(spec.loss)(xi, t64[i]), xi)[0])
            return torch.stack(rows)

        return CaseSetup([*stock_and_batchrules(lambda: stock(x, t)),
                          Variant("composed", lambda: composed(x, t), routing=False),
                          Variant("hand_written", lambda: spec.hand_written(x, t))],
                         reference=reference, floor=vmap_identity((0, 0), (x, t), returned=0))

    return Case("loss_grad", f"{spec.name}/b{BATCH}", "small", 0,
                f"per-sample vmap(grad) of {spec.name} on [1, {CLASSES}], batch {BATCH}", build,
                [NOT_SLOWER])


def cases(mode: str) -> List[Case]:
    """Per-loss cases for a mode."""
    return [_case(s) for s in SPECS if mode in s.modes]
