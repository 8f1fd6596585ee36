"""The engine (``PrivateModule`` + ``DPOptimizer``) in the user's loop, exact:
one step with noise 0 and ``SGD(lr=1)`` moves the parameters by
``-(1/B) sum_i clip_C(g_i)`` (``-sum_i`` for ``loss_reduction="sum"``), in
float64 against a loop of one backward per sample, on an MLP, a CNN with
GroupNorm, an LSTM classifier, transformers' BERT and GPT-2 (2-D attention
masks, right padding) and a peft LoRA (only the adapters move); C is the
median per-sample norm, so some samples are clipped and some not. Also what
the engine refuses or catches before any update (BatchNorm in training mode, a
model that mixes samples), an empty batch, gradient accumulation, and a
logical batch in pieces with skipped steps."""
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchrules.dp.engine import DPOptimizer, PrivateModule

# The engine eager, and its PrivateModule compiled (Note [The engine under torch.compile]).
BACKENDS = pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
# Each PrivateModule is a graph of its own: without a reset, the tests' modules
# would reach Dynamo's recompile limit for PrivateModule.forward.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

REL = 1e-9
EPS = 1e-6  # the clipping's: coef = min(1, C / (norm + EPS))
VOCAB, T = 50, 10
# A batch: (args, kwargs) of the model, and the targets the loss takes.
Batch = Tuple[Tuple[Any, ...], Dict[str, Any], Any]
Loss = Callable[[Any, Any, Dict[str, Any]], Tensor]  # (outputs, targets, kwargs) -> per-sample [B]


def rows(batch: Batch, index: Any) -> Batch:
    args, kwargs, targets = batch
    return (tuple(a[index] for a in args), {k: v[index] for k, v in kwargs.items()},
            targets[index])


def loop_clipped_sum(model: nn.Module, batch: Batch, per_sample: Loss,
                     max_norm: Optional[float] = None) -> Tuple[Dict[str, Tensor], Tensor, float]:
    """Per sample, its own backward: the sum of the clipped gradients of the
    trainable parameters, the norms, and C (the median norm when not given)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads: List[Tuple[Tensor, ...]] = []
    training = model.training
    model.eval()  # dropout off; the tests' models have none in training either
    for i in range(len(batch[2])):
        args, kwargs, targets = rows(batch, slice(i, i + 1))
        loss = per_sample(model(*args, **kwargs), targets, kwargs).sum()
        grads.append(torch.autograd.grad(loss, list(params.values()), allow_unused=True))
    model.train(training)
    grads = [tuple(torch.zeros_like(p) if g is None else g for g, p in zip(gs, params.values()))
             for gs in grads]
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in grads])
    c = norms.median().item() if max_norm is None else max_norm
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for gs, norm in zip(grads, norms):
        coef = min(1.0, c / (norm.item() + EPS))
        for n, g in zip(params, gs):
            total[n] += coef * g
    return total, norms, c


def engine_step(model: nn.Module, batches: List[Batch], per_sample: Loss, max_norm: float,
                expected_batch_size: int, reduction: str = "mean", noise: float = 0.0,
                generator: Optional[torch.Generator] = None,
                backend: Optional[str] = None) -> Dict[str, Tensor]:
    """One engine step with SGD(lr=1), a backward per batch: how each
    parameter moved; with ``backend``, the PrivateModule compiled
    (``fullgraph=True``)."""
    private = PrivateModule(model, loss_reduction=reduction)
    optimizer = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                            lr=1.0),
                            module=private, noise_multiplier=noise, max_grad_norm=max_norm,
                            expected_batch_size=expected_batch_size, loss_reduction=reduction,
                            generator=generator)
    forward = private if backend is None else torch.compile(private, fullgraph=True, backend=backend)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    for args, kwargs, targets in batches:
        losses = per_sample(forward(*args, **kwargs), targets, kwargs)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
    optimizer.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def assert_moved_by(moved: Dict[str, Tensor], want: Dict[str, Tensor]) -> None:
    """Trainable parameters moved by ``want``, the others not at all."""
    scale = max(w.abs().max().item() for w in want.values())
    for n, m in moved.items():
        w = want.get(n, torch.zeros_like(m))
        err = (m - w).abs().max().item()
        assert err <= REL * scale, f"{n}: moved off by {err:.3g} (scale {scale:.3g})"
        if n not in want:
            assert not m.any(), f"{n} is frozen but moved"


def check_exact(model: nn.Module, batch: Batch, per_sample: Loss, reduction: str = "mean",
                backend: Optional[str] = None) -> None:
    want, norms, c = loop_clipped_sum(model, batch, per_sample)
    assert (norms > c + EPS).any() and (norms < c).any()  # some clipped, some not
    b = len(batch[2])
    moved = engine_step(model, [batch], per_sample, c, b, reduction, backend=backend)
    divisor = b if reduction == "mean" else 1
    assert_moved_by(moved, {n: -w / divisor for n, w in want.items()})


# --- models and their per-sample losses ---------------------------------------------------------

def cross_entropy(out: Tensor, y: Tensor, kwargs: Dict[str, Any]) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def mlp_batch(b: int = 6) -> Tuple[nn.Module, Batch]:
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return model, ((torch.randn(b, 5, dtype=torch.float64),), {}, torch.randint(0, 3, (b,)))


def padding_mask(b: int) -> Tensor:
    """Right padding: sample i keeps its first few tokens (one keeps all)."""
    lengths = torch.tensor([T, 6, 3, 8, 5, 9][:b])
    return (torch.arange(T) < lengths[:, None]).long()


def token_loss(out: Any, ids: Tensor, kwargs: Dict[str, Any]) -> Tensor:
    """A causal LM's per-sample loss: the mean of its shifted token losses, padding ignored."""
    logits, mask = out.logits[:, :-1], kwargs["attention_mask"][:, 1:].to(torch.float64)
    tokens = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(),
                             reduction="none").view(ids.shape[0], -1)
    return (tokens * mask).sum(1) / mask.sum(1)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double()


def lm_batch(b: int = 6) -> Batch:
    ids = torch.randint(0, VOCAB, (b, T))
    return (), {"input_ids": ids, "attention_mask": padding_mask(b)}, ids


@BACKENDS
def test_mlp(backend: Optional[str]) -> None:
    check_exact(*mlp_batch(), cross_entropy, backend=backend)


@BACKENDS
def test_mlp_sum_reduction(backend: Optional[str]) -> None:
    check_exact(*mlp_batch(), cross_entropy, reduction="sum", backend=backend)


@BACKENDS
def test_cnn_with_group_norm(backend: Optional[str]) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3)).double()
    batch = ((torch.randn(6, 3, 8, 8, dtype=torch.float64),), {}, torch.randint(0, 3, (6,)))
    check_exact(model, batch, cross_entropy, backend=backend)


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, ids: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out[:, -1])


@BACKENDS
def test_lstm_classifier(backend: Optional[str]) -> None:
    batch = ((torch.randint(0, VOCAB, (6, 7)),), {}, torch.randint(0, 3, (6,)))
    check_exact(LSTMClassifier().double(), batch, cross_entropy, backend=backend)


@pytest.mark.requires("transformers")
@BACKENDS
def test_gpt2_with_padding(backend: Optional[str]) -> None:
    check_exact(gpt2(), lm_batch(), token_loss, backend=backend)


@pytest.mark.requires("transformers")
@BACKENDS
def test_bert_classifier_with_padding(backend: Optional[str]) -> None:
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    model = BertForSequenceClassification(config).double()
    ids = torch.randint(0, VOCAB, (6, T))
    batch: Batch = ((), {"input_ids": ids, "attention_mask": padding_mask(6)},
                    torch.randint(0, 3, (6,)))
    check_exact(model, batch, lambda out, y, kw: F.cross_entropy(out.logits, y, reduction="none"),
                backend=backend)


@pytest.mark.requires("transformers", "peft")
@BACKENDS
def test_peft_lora_moves_only_adapters(backend: Optional[str]) -> None:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(gpt2(), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                              init_lora_weights=False))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    check_exact(model, lm_batch(), token_loss, backend=backend)  # frozen parameters checked unmoved


# --- what the engine refuses or catches, before any update --------------------------------------

def test_batch_norm_in_training_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match=r"BatchNorm in training mode \(1\)"):
        PrivateModule(model)
    before = [p.detach().clone() for p in model.parameters()]
    private = PrivateModule(model.eval())  # frozen statistics are per sample
    model.train()  # switched back after wrapping: the forward refuses it
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), module=private, noise_multiplier=0.0,
                max_grad_norm=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match=r"BatchNorm in training mode \(1\)"):
        private(torch.randn(4, 4, dtype=torch.float64))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


class MixesSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        return self.second(h - h.mean(0))  # every sample's output depends on the others


@BACKENDS
def test_mixing_model_caught_by_first_step_validation(backend: Optional[str]) -> None:
    """Compiled, the validation keeps the first batch and draws its cotangents."""
    model = MixesSamples().double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = ((torch.randn(6, 4, dtype=torch.float64),), {}, torch.randint(0, 2, (6,)))
    with pytest.raises(RuntimeError, match=r"first-step validation.*first\.weight"):
        engine_step(model, [batch], cross_entropy, 1.0, 6, backend=backend)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@BACKENDS
def test_empty_batch_steps_with_noise_only(backend: Optional[str]) -> None:
    model, _ = mlp_batch()
    empty: Batch = ((torch.zeros(0, 5, dtype=torch.float64),), {}, torch.zeros(0, dtype=torch.long))
    sigma, c, b = 2.0, 0.5, 4
    moved = engine_step(model, [empty], lambda out, y, kw: out.sum(1), c, b, noise=sigma,
                        generator=torch.Generator().manual_seed(3), backend=backend)
    draws = torch.Generator().manual_seed(3)
    for n, p in model.named_parameters():
        # the engine's noise, drawn per parameter in order from the generator
        noise = torch.normal(0.0, sigma * c, p.shape, generator=draws, dtype=p.dtype)
        torch.testing.assert_close(moved[n], -noise / b, rtol=REL, atol=0)
    spread = torch.cat([m.flatten() for m in moved.values()]).std().item()
    assert math.isclose(spread, sigma * c / b, rel_tol=0.25)


@BACKENDS
def test_gradient_accumulation_equals_one_batch(backend: Optional[str]) -> None:
    """Two backwards then one step: the divisor is expected_batch_size (each
    backward's) times the backwards, the sums add up: one batch of both."""
    model, batch = mlp_batch(8)
    want, _, c = loop_clipped_sum(model, batch, cross_entropy)
    halves = [rows(batch, slice(0, 4)), rows(batch, slice(4, 8))]
    moved = engine_step(model, halves, cross_entropy, c, 4, backend=backend)
    assert_moved_by(moved, {n: -w / 8 for n, w in want.items()})


@BACKENDS
def test_skipped_step_pieces_equal_one_batch(backend: Optional[str]) -> None:
    """A logical batch in two physical pieces (BatchMemoryManager's loop: a
    step per piece, the first skipped): one batch of both, with
    expected_batch_size the logical batch's."""
    model, batch = mlp_batch(8)
    want, _, c = loop_clipped_sum(model, batch, cross_entropy)
    private = PrivateModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), module=private,
                            noise_multiplier=0.0, max_grad_norm=c, expected_batch_size=8)
    forward = private if backend is None else torch.compile(private, fullgraph=True, backend=backend)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k, skip in ((0, True), (1, False)):
        optimizer.signal_skip_step(skip)
        optimizer.zero_grad()
        args, _, targets = rows(batch, slice(4 * k, 4 * k + 4))
        F.cross_entropy(forward(*args), targets).backward()
        optimizer.step()
    moved = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    assert_moved_by(moved, {n: -w / 8 for n, w in want.items()})
