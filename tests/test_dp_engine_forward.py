"""The engine's batched forward (batchrules/dp/batched_forward.py): how calls that
take a parameter are split per sample, against a per-sample loop in float64."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchrules.dp.engine import DPOptimizer, PrivateModule

C = 0.7


def loop_reference(model, inputs, y):
    """sum_i clip_C(g_i), one backward per sample (model in float64, eval mode)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        out = model(*(x[i:i + 1] for x in inputs))
        grads = torch.autograd.grad(F.cross_entropy(out, y[i:i + 1], reduction="sum"), params)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += min(1.0, C / (float(norm) + 1e-6)) * g
    return total


def engine_step(model, inputs, y):
    """One step in the user's loop, noise 0, SGD(lr=1), loss a sum: the update."""
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    private = PrivateModule(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
                            module=private, noise_multiplier=0.0, max_grad_norm=C,
                            expected_batch_size=None, loss_reduction="sum")
    optimizer.zero_grad()
    F.cross_entropy(private(*inputs), y, reduction="sum").backward()
    optimizer.step()
    return [b - p.detach() for b, p in zip(before, [p for p in model.parameters() if p.requires_grad])]


def check(model, inputs, y):
    model = model.double().eval()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    expected = loop_reference(model, inputs, y)
    for got, want in zip(engine_step(model, inputs, y), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


class FlatRows(nn.Module):
    """GPT-2's Conv1D: ``addmm`` of the batch's rows flattened to ``[B*T, I]``."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.addmm(self.b, x.view(-1, x.shape[-1]), self.w).view(*x.shape[:-1], 3).sum(1)


class Positions(nn.Module):
    """A ``[1, T]`` position embedding broadcast over the batch, as transformers builds it."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 3)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None])
        return self.head(h.mean(1))


class Scaled(nn.Module):
    """A parameter in a call no rule handles (per-sample copies) and a matmul."""

    def __init__(self):
        super().__init__()
        self.scale, self.w = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.matmul(F.relu(x * self.scale), self.w)


class Recurrent(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.lstm, self.head = nn.LSTM(4, 5, num_layers=2, batch_first=batch_first), nn.Linear(5, 3)

    def forward(self, x):
        h, _ = self.lstm(x if self.batch_first else x.transpose(0, 1))
        return self.head((h if self.batch_first else h.transpose(0, 1))[:, -1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.mha, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

    def forward(self, x, padding):
        h = self.layer(x)
        h, _ = self.mha(h, h, h, key_padding_mask=padding)
        return self.head(h[:, 0])


def test_rows_of_a_flattened_batch():
    check(FlatRows(), (torch.randn(5, 2, 4),), torch.randint(0, 3, (5,)))


def test_a_shared_position_embedding():
    check(Positions(), (torch.randint(0, 10, (5, 6)),), torch.randint(0, 3, (5,)))


def test_per_sample_copies_and_an_inplace_relu():
    check(Scaled(), (torch.randn(5, 4),), torch.randint(0, 3, (5,)))
    mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))
    check(mlp, (torch.randn(5, 4),), torch.randint(0, 3, (5,)))


class LinearInputs(nn.Module):
    """One linear over a batch-first input, a flattened batch's rows, a
    sample's leading dims, and a row shared by the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        flat = self.lin(x.reshape(-1, 4)).view(x.shape[0], -1, 3)  # [B*2, I]: sample i's 2 rows
        shared = self.lin(torch.ones(1, 4, dtype=x.dtype))  # [1, I]: the per-call vmap
        return self.lin(x).sum(1) + flat.sum(1) + shared + self.lin(x[:, 0])


def test_linear_on_the_plain_batch(monkeypatch):
    """Note [A rule on the plain batch]: a linear of a [k*B, ..., I] input and
    an addmm of a [k*B, I] one run without the per-call vmap, a shared row with
    it; all equal to the per-sample loop."""
    from batchrules.dp import batched_forward

    levels = []
    real = batched_forward.vmap_level

    def counted(*args):
        levels.append(args)
        return real(*args)

    def forward_levels(model, x):
        levels.clear()
        private = PrivateModule(model, validate=False)
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=private,
                    noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=5)
        private(x)
        return len(levels)

    monkeypatch.setattr(batched_forward, "vmap_level", counted)
    x = torch.randn(5, 2, 4)
    check(LinearInputs(), (x,), torch.randint(0, 3, (5,)))
    assert forward_levels(LinearInputs(), x) == 1  # the shared row's

    def mlp():
        return nn.Sequential(nn.Linear(4, 6), nn.SiLU(), nn.Linear(6, 3))

    check(mlp(), (x[:, 0],), torch.randint(0, 3, (5,)))
    assert forward_levels(mlp(), x[:, 0]) == 0
    assert forward_levels(FlatRows(), x) == 0  # addmm of [B*T, I] (test_rows_of_a_flattened_batch)


class FlatLinear(nn.Module):
    """A linear over a batch's rows flattened to ``[B*T, I]``, then per sample."""

    def __init__(self, features):
        super().__init__()
        self.lin, self.head = nn.Linear(features, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x.reshape(x.shape[0] * x.shape[1], x.shape[-1]))
        return self.head(h.view(x.shape[0], x.shape[1], 4).sum(1))


@pytest.mark.parametrize("steps,features", [(0, 4), (3, 0), (0, 0)])
@pytest.mark.parametrize("plain", [True, False])
def test_empty_rows_and_features(steps, features, plain, monkeypatch):
    """Zero-length sequences flattened ([0, I] rows of a batch of 5: none a
    sample) and inputs with no features run as eager, on the plain batch
    (Note [A rule on the plain batch]) and under the per-call vmap."""
    if not plain:
        monkeypatch.setattr("batchrules.dp.batched_forward.BATCH_FIRST", {})
    check(FlatLinear(features), (torch.randn(5, steps, features),), torch.randint(0, 3, (5,)))


@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_layers(batch_first):
    check(Recurrent(batch_first), (torch.randn(5, 3, 4),), torch.randint(0, 3, (5,)))


def test_attention_layers():
    padding = torch.zeros(5, 4, dtype=torch.bool)
    padding[1, 3:] = padding[3, 2:] = True
    check(Attention(), (torch.randn(5, 4, 8), padding), torch.randint(0, 3, (5,)))


def test_a_first_layer_forms_no_weight_gradient():
    """The first layer's output is anchored (Note [Anchored outputs]): the
    backward runs no embedding backward but the clipped sum's own."""
    model = Positions()
    private = PrivateModule(model, validate=False)
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=private, noise_multiplier=0.0,
                max_grad_norm=C, expected_batch_size=5)
    loss = F.cross_entropy(private(torch.randint(0, 10, (5, 6))), torch.randint(0, 3, (5,)))
    with torch.profiler.profile() as prof:
        loss.backward()
    calls = [e.key for e in prof.key_averages() if e.key == "aten::embedding_dense_backward"]
    counts = {e.key: e.count for e in prof.key_averages()}
    assert calls and counts["aten::embedding_dense_backward"] == 2  # the two tables' clipped sums


def test_a_parameter_outside_any_split_call_is_reported():
    class Transposed(nn.Linear):
        def forward(self, x):
            return x @ self.weight.t()

    model = Transposed(4, 3, bias=False)
    private = PrivateModule(model)
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=private, noise_multiplier=0.0,
                max_grad_norm=C, expected_batch_size=5)
    loss = F.cross_entropy(private(torch.randn(5, 4)), torch.randint(0, 3, (5,)))
    with pytest.raises(RuntimeError, match=r"weight reached the loss through a call that cannot"):
        loss.backward()


def test_a_second_backward_through_one_forward_is_refused():
    model = nn.Linear(4, 3)
    private = PrivateModule(model)
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=private, noise_multiplier=0.0,
                max_grad_norm=C, expected_batch_size=5)
    loss = F.cross_entropy(private(torch.randn(5, 4)), torch.randint(0, 3, (5,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same forward"):
        loss.backward()


def test_no_optimizer_attached():
    with pytest.raises(RuntimeError, match="has no DPOptimizer"):
        PrivateModule(nn.Linear(4, 3))(torch.randn(2, 4))


def test_an_empty_batch_counts_as_a_backward():
    """As Opacus counts it: an empty batch and a full one accumulated divide the
    mean's sum by twice the expected batch size."""
    model = nn.Linear(3, 2).double()
    private = PrivateModule(model, validate=False)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), module=private,
                            noise_multiplier=0.0, max_grad_norm=1e6, expected_batch_size=4)
    x = torch.randn(4, 3, dtype=torch.float64)
    before = model.weight.detach().clone()
    private(x[:0]).sum(1).mean().backward()
    private(x).sum(1).mean().backward()
    optimizer.step()
    # each sample's gradient of its output's sum is ones(2) x x_i
    expected = torch.ones(2, 1, dtype=torch.float64) * x.sum(0) / 8
    torch.testing.assert_close(before - model.weight.detach(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_zero_length_sequence_raises_eagers_error(batch_first):
    lstm = nn.LSTM(3, 4, batch_first=batch_first)
    private = PrivateModule(lstm)
    DPOptimizer(torch.optim.SGD(lstm.parameters(), lr=0.1), module=private, noise_multiplier=0.0,
                max_grad_norm=C, expected_batch_size=2)
    x = torch.randn(2, 0, 3) if batch_first else torch.randn(0, 2, 3)
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0") as eager:
        lstm(x)
    with pytest.raises(RuntimeError) as engine:
        private(x)
    assert str(engine.value) == str(eager.value)
