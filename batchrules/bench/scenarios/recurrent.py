"""Recurrent layers (``nn.LSTM``, ``nn.GRU``) under torch.func; stock vmap
cannot run them ("Batching rule not implemented for aten::lstm.input"),
stock ``vmap(grad)`` runs them through the per-example fallback.

- rnn_ensemble_fwd / _train: N stacked layers on one shared batch, forward and
  vmap(grad(mse)). stock: a per-member functional_call loop; limit: the
  hand-batched recurrence; loop: one fused ``torch._VF`` call per member.
- psg_lstm: per-sample grads of an LSTM classifier; limit: backpropagation
  through time by hand. dp_lstm: its DP step (clipped_grad, skipped with its
  error if it refuses the model; the non-private step; Opacus' DPLSTM).
"""
import contextlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

from ..baselines import hand_written_recurrent as hw
from ..baselines.opacus_variants import cross_entropy_sum, opacus_clip_variant, with_opacus
from ..case import Case, CaseSetup, Variant, vmap_identity
from ..models import cross_entropy, detached_params, in_float64, mse, stacked_ensemble
from ..targets import Speedup
from .dp_step import COMPILED_FASTER, MAX_NORM, clipped_grad_variant, loop_reference, summed_reference
from .per_sample_grads import psg_setup

RNN = {"lstm": nn.LSTM, "gru": nn.GRU}
QUICK, FULL = frozenset({"quick", "full"}), frozenset({"full"})


class Recurrent(nn.Module):
    """A batch-first ``nn.LSTM`` / ``nn.GRU`` returning its output sequence."""

    def __init__(self, kind: str, in_features: int, hidden: int) -> None:
        super().__init__()
        self.rnn = RNN[kind](in_features, hidden, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0]


class LstmClassifier(nn.Module):
    """A 1-layer LSTM over the sequence; its last hidden state -> linear -> logits."""

    def __init__(self, in_features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(in_features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Size(NamedTuple):
    """Sequences [batch, steps, in_features]; ``members`` of an ensemble."""
    in_features: int = 32
    hidden: int = 32
    batch: int = 16
    steps: int = 20
    members: int = 8
    classes: int = 10


def failure(fn: Callable[[], object], stock: bool = False) -> Optional[str]:
    """None when ``fn()`` runs (``stock``: with routing off), else its error in one line."""
    try:
        with batchrules.enabled(False) if stock else contextlib.nullcontext():
            fn()
    except Exception as exc:  # noqa: BLE001 (any failure is reported)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def ensemble_case(kind: str, size: Size, train: bool, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        models = [Recurrent(kind, size.in_features, size.hidden).to(device) for _ in range(size.members)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach() for k, v in params.items()}
        keys = [f"rnn.{n}" for n in models[0].rnn._flat_weights_names]  # w_ih, w_hh, b_ih, b_hh
        x = torch.randn(size.batch, size.steps, size.in_features, device=device)
        y = torch.randn(size.batch, size.steps, size.hidden, device=device)
        x64, y64 = x.cpu().double(), y.cpu().double()
        member_params = [{k: v[e] for k, v in params.items()} for e in range(size.members)]

        def member(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(base, (p, b), (xi,))

        def member_loss(p: Dict[str, Tensor], b: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return mse(member(p, b, xi), yi)

        in_dims = (0, 0, None) + ((None,) if train else ())
        args = (params, buffers, x) + ((y,) if train else ())
        vmapped = vmap(grad(member_loss) if train else member, in_dims=in_dims)
        # Fresh leaves for the hand-written steps: stacked (limit), per member (loop).
        stacked = [params[k].clone().requires_grad_(train) for k in keys]
        per_member = [[t[e].clone().requires_grad_(train) for t in stacked] for e in range(size.members)]
        scale = 1.0 / (size.batch * size.steps * size.hidden)
        member_grad = grad(member_loss)

        def user_code() -> Dict[str, Tensor]:
            return vmapped(*args)

        def stock() -> Any:  # stock torch.func's way, vmap being out: a loop over the members
            if not train:
                return torch.stack([member(p, buffers, x) for p in member_params])
            rows = [member_grad(p, buffers, x, y) for p in member_params]
            return {k: torch.stack([r[k] for r in rows]) for k in params}

        def limit() -> Any:
            out = hw.ensemble_recurrence(kind, stacked, x)
            return list(torch.autograd.grad((out - y).square().sum() * scale, stacked)) if train else out

        def loop() -> Any:
            out = hw.member_loop(kind, per_member, x)
            if not train:
                return out
            flat = [t for ws in per_member for t in ws]
            grads = torch.autograd.grad((out - y).square().sum() * scale, flat)
            return [torch.stack(grads[j::len(keys)]) for j in range(len(keys))]

        def reference() -> Any:
            if not train:
                return torch.stack([in_float64(m)(x64) for m in models])
            rows = []
            for m in models:
                m64 = in_float64(m)
                rows.append(torch.autograd.grad(mse(m64(x64), y64), list(m64.parameters())))
            return [torch.stack(column) for column in zip(*rows)]

        why = failure(lambda: vmap(member, in_dims=(0, 0, None))(params, buffers, x), stock=True)
        return CaseSetup(
            variants=[Variant("stock", stock, routing=False, user_code=True),
                      Variant("batchrules", user_code, routing=True, user_code=True),
                      Variant("limit", limit), Variant("loop", loop)],
            reference=reference, notes=[] if why is None else [f"stock vmap: {why}"],
            floor=vmap_identity(in_dims, args, returned=0))

    step = "vmap(grad(mse)) over" if train else "forward of"
    return Case(
        "rnn_ensemble_train" if train else "rnn_ensemble_fwd", f"{kind}_h{size.hidden}", tier, 0,
        f"{step} {size.members} nn.{kind.upper()}({size.in_features}, {size.hidden}), shared input "
        f"[{size.batch}, {size.steps}, {size.in_features}]; stock: per-member functional_call loop "
        "(stock vmap cannot run it)", build,
        [Speedup("RNN ensemble: batchrules >= 0.95x the speed of the faster of loop and limit "
                 "(min(loop, limit) / batchrules >= 0.95)", ("loop", "limit"), "batchrules", 0.95)])


def _classifier(size: Size, device: torch.device) -> Tuple[nn.Module, Tensor, Tensor]:
    return (LstmClassifier(size.in_features, size.hidden, size.classes).to(device),
            torch.randn(size.batch, size.steps, size.in_features, device=device),
            torch.randint(0, size.classes, (size.batch,), device=device))


def _classifier_text(size: Size) -> str:
    return (f"LSTM({size.in_features}, {size.hidden}) over [{size.steps}, {size.in_features}], last hidden "
            f"-> linear to {size.classes}, cross-entropy, batch {size.batch}")


def per_sample_grads_case(size: Size, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        model, x, y = _classifier(size, device)
        def limit(p: Dict[str, Tensor]) -> List[Tensor]:
            return hw.lstm_classifier_per_sample_grads(list(p.values()), x, y)

        return psg_setup(model, x, y, limit)

    return Case(
        "psg_lstm", f"b{size.batch}", tier, 1, f"per-sample grads, {_classifier_text(size)}", build,
        [Speedup("LSTM per-sample grads: batchrules <= 1.3x the limit (limit / batchrules >= 0.77)",
                 "limit", "batchrules", 1 / 1.3),
         Speedup("LSTM per-sample grads: batchrules >= 5x faster than stock (stock / batchrules >= 5)",
                 "stock", "batchrules", 5.0)])


def dp_case(size: Size, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        model, x, y = _classifier(size, device)
        params, trainable = detached_params(model), list(model.parameters())

        def sample_loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        def nonprivate() -> List[Tensor]:
            return list(torch.autograd.grad(cross_entropy_sum(model(x), y), trainable))

        clipped = batchrules.clipped_grad(sample_loss, MAX_NORM)
        summed = Variant("nonprivate", nonprivate, reference=lambda: summed_reference(model, x, y))
        setup = CaseSetup([summed], reference=lambda: loop_reference(model, x, y))
        why = failure(lambda: clipped(params, x[:2], y[:2]))
        if why is None:
            setup.variants.insert(0, clipped_grad_variant(clipped, params, x, y))
        else:
            setup.skipped["clipped_grad"] = why
        # ModuleValidator.fix swaps nn.LSTM for Opacus' DPLSTM (same parameter names).
        return with_opacus(setup, ["opacus_hooks"], lambda: [opacus_clip_variant(
            model, x, y, cross_entropy_sum, MAX_NORM, lambda m: loop_reference(m, x, y))])

    return Case(
        "dp_lstm", f"b{size.batch}", tier, 1, f"DP-SGD clipping, {_classifier_text(size)}; Opacus: DPLSTM",
        build,
        [Speedup("DP LSTM: clipped_grad <= 1.3x the non-private step (nonprivate / clipped_grad >= 0.77)",
                 "nonprivate", "clipped_grad", 1 / 1.3), COMPILED_FASTER,
         Speedup("DP LSTM: clipped_grad >= 1.5x faster than Opacus DPLSTM (opacus_hooks)",
                 "opacus_hooks", "clipped_grad", 1.5)])


SMALL, MEDIUM = Size(hidden=32), Size(hidden=128)
CLASSIFIER = Size(hidden=128, batch=32)


def cases(mode: str) -> List[Case]:
    """The recurrent cases of a mode: the hidden-32 ensemble forwards and the
    per-sample gradients with --quick, every row with --full."""
    rows = [(QUICK, ensemble_case(k, SMALL, False, "small")) for k in RNN]
    rows += [(FULL, ensemble_case(k, MEDIUM, False, "medium")) for k in RNN]
    rows += [(FULL, ensemble_case(k, SMALL, True, "small")) for k in RNN]
    rows += [(FULL, ensemble_case(k, MEDIUM, True, "medium")) for k in RNN]
    rows += [(QUICK, per_sample_grads_case(CLASSIFIER, "medium")), (FULL, dp_case(CLASSIFIER, "medium"))]
    return [case for modes, case in rows if mode in modes]
