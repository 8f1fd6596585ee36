"""Transformers under torch.func: per-sample gradients and an ensemble of
encoder layers.

``vmap(grad(loss))`` over the samples of a batch gives every sample's gradient
of an ``nn.TransformerEncoderLayer`` (with a key-padding mask or a causal
mask); ``stack_module_state`` + ``functional_call`` + ``vmap`` runs and trains
several encoder layers as one. Attention runs the fused CPU kernel with
batchrules' batching rules instead of functorch's per-example fallback.

    python -m batchrules.examples.transformer
"""
import copy
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, stack_module_state, vmap

import batchrules

Params = Dict[str, Tensor]


def make_encoder(d_model: int = 64, nhead: int = 4, dim_feedforward: int = 128) -> nn.Module:
    """One batch-first encoder layer without dropout."""
    return nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=dim_feedforward,
                                      dropout=0.0, batch_first=True)


def encode(layer: nn.Module, params: Params, x: Tensor, padding_mask: Optional[Tensor] = None,
           causal: bool = False) -> Tensor:
    """The layer on ``x (B, T, d)`` with ``params``; ``padding_mask (B, T)`` is True at
    padded positions; ``causal`` lets position t attend to positions <= t only."""
    src_mask = nn.Transformer.generate_square_subsequent_mask(
        x.shape[-2], dtype=x.dtype) if causal else None
    return functional_call(layer, params, (x,), {"src_key_padding_mask": padding_mask,
                                                 "src_mask": src_mask, "is_causal": causal})


def per_sample_grads(layer: nn.Module, params: Params, x: Tensor, y: Tensor,
                     padding_mask: Optional[Tensor] = None, causal: bool = False) -> Params:
    """Gradient of each sample's mean squared error: entries ``(B, *param.shape)``.
    ``x`` and ``y`` are ``(B, T, d)``; ``padding_mask`` is ``(B, T)`` or None."""
    def loss(p: Params, xi: Tensor, yi: Tensor, mi: Optional[Tensor]) -> Tensor:
        # The layer expects a batch: run each sample as a batch of one.
        mask = None if mi is None else mi.unsqueeze(0)
        return F.mse_loss(encode(layer, p, xi.unsqueeze(0), mask, causal), yi.unsqueeze(0))

    in_dims = (None, 0, 0, None if padding_mask is None else 0)
    return vmap(grad(loss), in_dims=in_dims)(params, x, y, padding_mask)


def stack_layers(layers: List[nn.Module]) -> Tuple[nn.Module, Params, Params]:
    """``(base, params, buffers)``: a meta-device copy of the layer and the members'
    parameters and buffers stacked along a new leading dim."""
    params, buffers = stack_module_state(layers)
    return copy.deepcopy(layers[0]).to("meta"), params, buffers


def ensemble_forward(base: nn.Module, params: Params, buffers: Params, x: Tensor) -> Tensor:
    """Outputs ``(M, B, T, d)`` of M members, each on its minibatch ``x[m] (B, T, d)``."""
    def member(p: Params, b: Params, xb: Tensor) -> Tensor:
        return functional_call(base, (p, b), (xb,))

    return vmap(member)(params, buffers, x)


def ensemble_train_step(base: nn.Module, params: Params, buffers: Params, x: Tensor, y: Tensor,
                        optimizer: torch.optim.Optimizer) -> Tensor:
    """One step for all M members on their minibatches ``x[m], y[m] (B, T, d)``;
    ``optimizer`` holds the stacked parameters. Returns the M losses."""
    def loss(p: Params, b: Params, xb: Tensor, yb: Tensor) -> Tensor:
        return F.mse_loss(functional_call(base, (p, b), (xb,)), yb)

    detached = {k: v.detach() for k, v in params.items()}
    grads, losses = vmap(grad_and_value(loss))(detached, buffers, x, y)
    for name, p in params.items():
        p.grad = grads[name]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


def loop_per_sample_grads(layer: nn.Module, x: Tensor, y: Tensor,
                          padding_mask: Optional[Tensor] = None, causal: bool = False) -> Params:
    """The same gradients from one autograd call per sample."""
    params: Params = dict(layer.named_parameters())
    rows = []
    for i in range(x.shape[0]):
        mask = None if padding_mask is None else padding_mask[i:i + 1]
        out = encode(layer, params, x[i:i + 1], mask, causal)
        rows.append(torch.autograd.grad(F.mse_loss(out, y[i:i + 1]), list(params.values())))
    return {k: torch.stack(column) for k, column in zip(params, zip(*rows))}


def main() -> None:
    """Per-sample gradients of an encoder layer (checked against a loop) and a few
    training steps of an ensemble of 4 encoder layers."""
    torch.manual_seed(0)
    batch, seq, d_model = 8, 32, 64
    layer = make_encoder(d_model)
    params = {k: p.detach() for k, p in layer.named_parameters()}
    x, y = torch.randn(batch, seq, d_model), torch.randn(batch, seq, d_model)
    padding = torch.arange(seq) >= torch.randint(seq // 2, seq, (batch, 1))

    with batchrules.enabled():
        grads = per_sample_grads(layer, params, x, y, padding)
        print("self_attn.in_proj_weight:", tuple(grads["self_attn.in_proj_weight"].shape))
        loop = loop_per_sample_grads(layer, x, y, padding)
        print("matches loop:", all(torch.allclose(grads[k], loop[k], rtol=1e-4, atol=1e-6)
                                   for k in grads))

        members = 4
        base, stacked, buffers = stack_layers([make_encoder(d_model) for _ in range(members)])
        optimizer = torch.optim.Adam(stacked.values(), lr=1e-3)
        xs, ys = torch.randn(members, batch, seq, d_model), torch.randn(members, batch, seq, d_model)
        print("ensemble output:", tuple(ensemble_forward(base, stacked, buffers, xs).shape))
        for step in range(3):
            losses = ensemble_train_step(base, stacked, buffers, xs, ys, optimizer)
            print(f"step {step}: losses {[round(v, 4) for v in losses.tolist()]}")


if __name__ == "__main__":
    main()
