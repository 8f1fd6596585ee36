"""The DP-SGD example: one step against the per-sample loop, determinism, an
empty Poisson batch, the accountant and the sharded noise (its 2 gloo ranks
against one process: test_dp_ddp.py)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from dp_reference import loop_clipped_grad
from torch.func import functional_call

from batchrules.examples import dp_sgd

CONFIG = dp_sgd.DPConfig(steps=4, examples=48, sample_rate=0.1, noise_multiplier=0.7)


def one_draw_noise(params, config, seed=3):
    """The example's noise: one N(0, (sigma C)^2) draw over all parameters, split in order."""
    sizes = [p.numel() for p in params.values()]
    flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed))
    flat = flat * config.noise_multiplier * config.max_norm
    return [z.view(p.shape) for z, p in zip(flat.split(sizes), params.values())]


def test_step_is_clip_sum_noise_average() -> None:
    config = CONFIG
    x, y = dp_sgd.make_data(config)
    model = dp_sgd.make_model(config)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    dp_sgd.dp_step(model, optimizer, x[:6], y[:6], config, torch.Generator().manual_seed(3))

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)

    sums, _ = loop_clipped_grad(loss, config.max_norm, (before, x[:6], y[:6]))
    for (name, p), z in zip(model.named_parameters(), one_draw_noise(before, config)):
        want = before[name] - config.lr * (sums[name] + z) / (config.sample_rate * config.examples)
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


def test_empty_batch_adds_noise_only() -> None:
    config = CONFIG
    model = dp_sgd.make_model(config)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    norms = dp_sgd.dp_step(model, optimizer, torch.zeros(0, 20), torch.zeros(0, dtype=torch.int64),
                           config, torch.Generator().manual_seed(3))
    assert norms.shape == (0,)
    for (name, p), z in zip(model.named_parameters(), one_draw_noise(before, config)):
        torch.testing.assert_close(p.detach(), before[name] - config.lr * z / 4.8)


def test_training_is_seeded_and_accounted() -> None:
    first, epsilon = dp_sgd.train(CONFIG)
    second, again = dp_sgd.train(CONFIG)
    for k, v in first.state_dict().items():
        assert torch.equal(v, second.state_dict()[k])
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(CONFIG.steps):
        accountant.step(noise_multiplier=CONFIG.noise_multiplier, sample_rate=CONFIG.sample_rate)
    assert epsilon == again == accountant.get_epsilon(delta=CONFIG.delta)


def test_main_prints_progress_and_epsilon(capsys) -> None:
    dp_sgd.main(["--steps", "2"])
    out = capsys.readouterr().out
    assert "step 0: batch" in out and "step 1: batch" in out
    assert "epsilon" in out


def test_sharded_noise_adds_up_to_one_draw() -> None:
    """``add_noise_``: the shards' noise, each added by its own generator to
    its rows (a DDP rank's share), is the noise of one process drawing all
    shards; a 0-dim tensor's is added once, by shard 0; each shard's noise is
    one draw over all tensors' rows of the shard; FSDP's ``shard_noise``
    pieces are those rows."""
    config = dataclasses.replace(CONFIG, noise_shards=3)
    shapes = [(7, 2), (2, 4), (), (1,)]
    want = [torch.zeros(s) for s in shapes]
    dp_sgd.add_noise_(want, config, dp_sgd.noise_generators(config, range(3)))
    got = [torch.zeros(s) for s in shapes]
    for shard in range(3):
        dp_sgd.add_noise_(got, config, dp_sgd.noise_generators(config, [shard]), shard)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and (w != 0).all(), g.shape
    std = config.noise_multiplier * config.max_norm
    rows = {0: [3, 1, 1, 1], 1: [3, 1, 0, 0], 2: [1, 0, 0, 0]}  # torch.chunk's rows of 7, 2, (), 1
    for shard in range(3):
        pieces = dp_sgd.shard_noise([torch.Size(s) for s in shapes], config,
                                    dp_sgd.noise_generators(config, [shard])[0], shard)
        assert [p.shape[0] if p.dim() else 1 for p in pieces] == rows[shard]
        flat = torch.randn(sum(p.numel() for p in pieces),
                           generator=dp_sgd.noise_generators(config, [shard])[0]) * std
        assert torch.equal(torch.cat([p.flatten() for p in pieces]), flat)
        for w, piece, start in zip(want, pieces, [3 * shard, shard, 0, 0]):
            if piece.numel():  # the rows add_noise_ put there
                assert torch.equal(piece, w[start:start + piece.shape[0]] if w.dim() else w)
