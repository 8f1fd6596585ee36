"""Errors of the attention batching rules and the routing switch.

Bad per-example shapes raise naming one example's shapes; dropout in a fused
kernel follows vmap's randomness modes; disable() restores stock exactly.
"""
import pytest
import torch
from attention_reference import N, attention_args, flash, sdpa
from torch.func import vmap

import batchrules
from batchrules._compat import dispatch_has_kernel

FUSED_CPU = ["aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
CUDA_BACKWARDS = ["aten::_scaled_dot_product_flash_attention_backward",
                  "aten::_scaled_dot_product_efficient_attention_backward",
                  "aten::_scaled_dot_product_cudnn_attention_backward"]
CUDA_FORWARDS_WITH_BIAS = ["aten::_scaled_dot_product_efficient_attention",
                           "aten::_scaled_dot_product_cudnn_attention"]


@pytest.mark.usefixtures("routing_on", "no_vmap_fallback")
class TestShapes:
    def test_batch_mismatch_names_example_shapes(self) -> None:
        q, k, v, _ = attention_args(None, (0, 0, 0))
        with pytest.raises(RuntimeError, match=r"same batch size.*key of shape \[1, 4, 6, 8\]"):
            vmap(flash)(q, k[:, :1], v[:, :1])

    def test_three_dim_operand(self) -> None:
        q, k, v, _ = attention_args(None, (0, 0, 0))
        with pytest.raises(RuntimeError, match=r"query of one example to be 4-D.*\[4, 5, 8\]"):
            vmap(flash, in_dims=(0, None, None))(q[:, 0], k[0], v[0])

    def test_mask_rank(self) -> None:
        q, k, v, _ = attention_args(None, (0, 0, 0))
        mask = torch.zeros(N, 1, 5, 6, dtype=torch.float64)
        with pytest.raises(RuntimeError, match=r"attn_mask of one example to be 2-D.*\[1, 5, 6\]"):
            vmap(flash)(q, k, v, mask)

    def test_mask_batch(self) -> None:
        q, k, v, _ = attention_args(None, (0, 0, 0))
        mask = torch.zeros(N, 3, 1, 5, 6, dtype=torch.float64)
        with pytest.raises(RuntimeError, match=r"must be 1 or the query's 2"):
            vmap(flash)(q, k, v, mask)


@pytest.mark.usefixtures("routing_on", "no_vmap_fallback")
class TestDropoutRandomness:
    def test_error_mode_raises_like_functorch(self) -> None:
        q, k, v, _ = attention_args(None, (0, 0, 0))
        with pytest.raises(RuntimeError, match="randomness error mode"):
            vmap(lambda q, k, v: flash(q, k, v, dropout_p=0.1))(q, k, v)

    def test_same_mode_raises(self) -> None:
        q, k, v, _ = attention_args(None, (0, 0, 0))
        with pytest.raises(RuntimeError, match=r"randomness='same'\) is not supported"):
            vmap(lambda q, k, v: flash(q, k, v, dropout_p=0.1), randomness="same")(q, k, v)

    def test_different_mode_reaches_the_kernel(self) -> None:
        # The CPU kernel has no dropout; the fold passes it the call it would get.
        q, k, v, _ = attention_args(None, (0, 0, 0))
        with pytest.raises(RuntimeError, match="do not support dropout"):
            vmap(lambda q, k, v: flash(q, k, v, dropout_p=0.1), randomness="different")(q, k, v)

    def test_sdpa_dropout_keeps_functorch_semantics(self) -> None:
        # SDPA runs dropout through its math composite on CPU: "same" gives
        # every example the same mask, as stock.
        q, k, v, _ = attention_args(None, (None, None, None))
        qs = q.expand(N, *q.shape)
        out = vmap(lambda q: sdpa(q, k, v, dropout_p=0.5), randomness="same")(qs)
        torch.testing.assert_close(out[0], out[1])
        out = vmap(lambda q: sdpa(q, k, v, dropout_p=0.5), randomness="different")(qs)
        assert not torch.allclose(out[0], out[1])


def test_enable_registers_and_disable_restores() -> None:
    with batchrules.enabled(False):
        stock = {op: dispatch_has_kernel(op, "FuncTorchBatched")
                 for op in FUSED_CPU + CUDA_BACKWARDS + CUDA_FORWARDS_WITH_BIAS}
        stock_front = dispatch_has_kernel("aten::scaled_dot_product_attention",
                                          "FuncTorchDynamicLayerFrontMode")
        with batchrules.enabled(True):
            for op in FUSED_CPU + CUDA_BACKWARDS + CUDA_FORWARDS_WITH_BIAS:
                assert dispatch_has_kernel(op, "FuncTorchBatched"), op
            assert dispatch_has_kernel("aten::scaled_dot_product_attention",
                                       "FuncTorchDynamicLayerFrontMode")
        assert {op: dispatch_has_kernel(op, "FuncTorchBatched") for op in stock} == stock
        assert dispatch_has_kernel("aten::scaled_dot_product_attention",
                                   "FuncTorchDynamicLayerFrontMode") == stock_front
    # torch 2.13: the CPU kernels and the CUDA backwards have no rule of their own.
    assert not any(stock[op] for op in FUSED_CPU + CUDA_BACKWARDS)


@pytest.mark.usefixtures("no_vmap_fallback")
def test_disabled_is_stock_again() -> None:
    q, k, v, _ = attention_args(None, (0, 0, 0))
    with batchrules.enabled(True):
        vmap(flash)(q, k, v)
    with batchrules.enabled(False):
        with pytest.raises(RuntimeError, match="vmap fallback"):
            vmap(flash)(q, k, v)
