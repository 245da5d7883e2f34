"""Abstract evaluation of the primitives: output shapes and dtypes, shape checks, and the
varying manual axes (shard_map) of the outputs.

Every operand carries a leading batch axis of extent B or 1 (broadcast); outputs have B.
The public ops pass operands whose varying manual axes already agree
(`_compat.pvary_to_match`), so every output varies along that same set."""

from __future__ import annotations

import jax.numpy as jnp

from . import reference
from ._compat import shaped_like
from .batch_axis import batch_extent

MAX_ROWS = 2**31 - 1  # row_map is int32


def _check_weights(weights, row_map, has_weights: bool, op: str) -> None:
    if has_weights and weights.shape[1:] != row_map.shape[1:]:
        raise ValueError(f"{op}: topk_weights shape {tuple(weights.shape[1:])} differs from row_map shape "
                         f"{tuple(row_map.shape[1:])}")


def permute(hidden, ids, expert_map, *, num_experts, num_local_experts, align_size, has_map):
    avals = (hidden, ids, expert_map)
    B = batch_extent(*avals)
    _, T, K = ids.shape
    if hidden.shape[1] != T:
        raise ValueError(f"moe_permute: hidden has {hidden.shape[1]} tokens (T) but topk_ids has {T}")
    if has_map and expert_map.shape[1] != num_experts:
        raise ValueError(f"moe_permute: expert_map must have shape ({num_experts},), got {tuple(expert_map.shape[1:])}")
    rows = reference.permuted_rows(T * K, num_local_experts, align_size)
    if rows > MAX_ROWS:
        raise ValueError(
            f"moe_permute: the permuted buffer would need {rows} rows (T*K={T * K}, align_size={align_size}); "
            f"row_map is int32, so at most {MAX_ROWS} rows are supported"
        )
    return (
        shaped_like(avals, (B, rows, hidden.shape[2]), hidden.dtype),
        shaped_like(avals, (B, num_local_experts), jnp.int32),
        shaped_like(avals, (B, T, K), jnp.int32),
    )


def unpermute(x, row_map, weights, *, out_dtype, has_weights):
    _check_weights(weights, row_map, has_weights, "moe_unpermute")
    B = batch_extent(x, row_map, weights)
    return shaped_like((x, row_map, weights), (B, row_map.shape[1], x.shape[2]), out_dtype)


def unpermute_add(x, row_map, weights, residual, *, has_weights):
    _check_weights(weights, row_map, has_weights, "moe_unpermute")
    want = (row_map.shape[1], x.shape[2])
    if tuple(residual.shape[1:]) != want:
        raise ValueError(f"moe_unpermute: residual must have shape {want}, got {tuple(residual.shape[1:])}")
    avals = (x, row_map, weights, residual)
    return shaped_like(avals, (batch_extent(*avals),) + want, residual.dtype)


def scatter(x, row_map, weights, *, num_rows, out_dtype, has_weights):
    _check_weights(weights, row_map, has_weights, "moe_scatter")
    if x.shape[1] != row_map.shape[1]:
        raise ValueError(f"moe_scatter: x has {x.shape[1]} tokens but row_map has {row_map.shape[1]}")
    B = batch_extent(x, row_map, weights)
    return shaped_like((x, row_map, weights), (B, num_rows, x.shape[2]), out_dtype)


def weight_grad(c, x, row_map, *, out_dtype):
    if c.shape[1] != row_map.shape[1] or c.shape[2] != x.shape[2]:
        raise ValueError(f"moe_weight_grad: shapes {c.shape}, {x.shape}, {row_map.shape} disagree")
    B = batch_extent(c, x, row_map)
    return shaped_like((c, x, row_map), (B,) + row_map.shape[1:], out_dtype)


def unpermute_tangent(dx, dw, x, row_map, weights, *, out_dtype):
    _check_weights(weights, row_map, True, "moe_unpermute")
    avals = (dx, dw, x, row_map, weights)
    B = batch_extent(*avals)
    return shaped_like(avals, (B, row_map.shape[1], x.shape[2]), out_dtype)


def unpermute_bwd(c, x, row_map, weights, *, x_out_dtype, w_out_dtype):
    _check_weights(weights, row_map, True, "moe_unpermute_bwd")
    avals = (c, x, row_map, weights)
    B = batch_extent(*avals)
    return (shaped_like(avals, (B,) + x.shape[1:], x_out_dtype),
            shaped_like(avals, (B,) + row_map.shape[1:], w_out_dtype))
