"""The library's contract in plain jax.numpy: argsort + take to permute, an inverse gather
plus a float32 weighted sum to unpermute (the strong form MaxText-style MoE layers use).

Tests check the kernels against it, the lowering falls back to it on platforms without
kernels, and the benchmark times it as what JAX users write today.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class PermuteResult(NamedTuple):
    """What `moe_permute` returns (a pytree).

    hidden:      [R, H] rows grouped by local expert (ascending), stable in t*K+k inside an
                 expert; padding and tail rows are zero.
    group_sizes: [L] int32 rows of each local expert's block, padding included (the
                 `group_sizes` of `jax.lax.ragged_dot`).
    row_map:     [T, K] int32 row of `hidden` holding entry (t, k), or -1 when dropped.
    """

    hidden: jax.Array
    group_sizes: jax.Array
    row_map: jax.Array


def permuted_rows(entries: int, num_local_experts: int, align_size: int) -> int:
    """Rows of the permuted buffer: the tight worst case over all routings."""
    if align_size == 1:
        return entries
    busy = min(entries, num_local_experts)
    return (entries + busy * (align_size - 1)) // align_size * align_size


def to_int32(x: jax.Array) -> jax.Array:
    """Integer ids as int32 without wrap-around: wider values saturate (they are invalid anyway)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.int32:
        return x
    if jnp.iinfo(x.dtype).bits > 32 or x.dtype == jnp.uint32:
        x = jnp.clip(x, -1 if jnp.issubdtype(x.dtype, jnp.signedinteger) else 0, np.iinfo(np.int32).max)
    return x.astype(jnp.int32)


def local_experts(topk_ids, num_experts, expert_map=None, num_local_experts=None):
    """[T*K] local expert of every entry, or L where the entry is dropped."""
    ids = to_int32(topk_ids).reshape(-1)
    L = num_experts if expert_map is None else num_local_experts
    in_range = (ids >= 0) & (ids < num_experts)
    local = ids if expert_map is None else to_int32(expert_map)[jnp.clip(ids, 0, num_experts - 1)]
    keep = in_range & (local >= 0) & (local < L)
    return jnp.where(keep, local, L), L


def moe_permute(hidden, topk_ids, num_experts, *, expert_map=None, num_local_experts=None, align_size=1):
    """Reference of `jax_moe_permute.moe_permute`; returns the same PermuteResult."""
    T, H = hidden.shape
    K = topk_ids.shape[1]
    N = T * K
    local, L = local_experts(topk_ids, num_experts, expert_map, num_local_experts)
    R = permuted_rows(N, L, align_size)
    order = jnp.argsort(local, stable=True)  # ascending flat index within an expert
    counts = jnp.zeros(L + 1, jnp.int32).at[local].add(1)[:L]
    padded = (counts + align_size - 1) // align_size * align_size
    starts = jnp.cumsum(padded) - padded
    first_sorted = jnp.cumsum(counts) - counts  # where each expert begins in `order`
    sorted_local = local[order]
    kept = sorted_local < L
    safe = jnp.where(kept, sorted_local, 0)
    rows_sorted = starts[safe] + jnp.arange(N, dtype=jnp.int32) - first_sorted[safe]
    row_map = jnp.zeros(N, jnp.int32).at[order].set(jnp.where(kept, rows_sorted, -1))
    source = jnp.full(R, -1, jnp.int32).at[jnp.where(kept, rows_sorted, R)].set(order.astype(jnp.int32), mode="drop")
    if T == 0:  # nothing to take from (and jax's take cannot differentiate an empty gather)
        return PermuteResult(jnp.zeros((R, H), hidden.dtype), padded.astype(jnp.int32), row_map.reshape(T, K))
    rows = jnp.take(hidden, jnp.maximum(source, 0) // max(K, 1), axis=0)
    out = jnp.where((source >= 0)[:, None], rows, jnp.zeros((), hidden.dtype))
    return PermuteResult(out, padded.astype(jnp.int32), row_map.reshape(T, K))


def moe_unpermute(expert_out, row_map, topk_weights=None, *, out_dtype=None):
    """Reference of `jax_moe_permute.moe_unpermute`: out[t] = sum_k w[t,k] * expert_out[row_map[t,k]]."""
    R = expert_out.shape[0]
    row_map = to_int32(row_map)
    if R == 0 or row_map.size == 0:  # nothing to gather
        return jnp.zeros((row_map.shape[0], expert_out.shape[1]), out_dtype or expert_out.dtype)
    valid = (row_map >= 0) & (row_map < R)
    rows = jnp.take(expert_out, jnp.where(valid, row_map, 0), axis=0).astype(jnp.float32)  # [T, K, H]
    w = jnp.ones(row_map.shape, jnp.float32) if topk_weights is None else topk_weights.astype(jnp.float32)
    out = jnp.sum(jnp.where(valid[..., None], rows * w[..., None], 0.0), axis=1)
    return out.astype(out_dtype or expert_out.dtype)


# ---- routing: route's choice and gates --------------------------------------------------------

def router_scores(logits: jax.Array, scoring: str) -> jax.Array:
    """[T, E] float32 scores of float32 logits: softmax over the experts, or the sigmoid."""
    return jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)


def group_mask(choice: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """[T, E] bool: experts in the topk_groups best groups, a group scored by the sum of its
    two best selection scores (DeepSeek-V3's node-limited routing)."""
    T, E = choice.shape
    grouped = choice.reshape(T, num_groups, E // num_groups)
    best = jax.lax.top_k(grouped, min(2, E // num_groups))[0]
    _, top_groups = jax.lax.top_k(best.sum(-1), topk_groups)
    keep = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
    return jnp.repeat(keep, E // num_groups, axis=1)


def route_weights(logits, ids, *, scoring="softmax", renormalize=True, routed_scaling_factor=1.0):
    """route's gates of the chosen `ids` [T, K]: differentiable in `logits` [T, E] (any float
    dtype, computed on in float32); the choice itself carries no gradient."""
    scores = router_scores(logits.astype(jnp.float32), scoring)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        # DeepSeek-V3 adds 1e-20 (sigmoid scores can all be tiny); softmax ones cannot.
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * jnp.float32(routed_scaling_factor)


def route_topk(logits, top_k, *, scoring="softmax", renormalize=True, bias=None, num_groups=None,
               topk_groups=None, routed_scaling_factor=1.0):
    """route's choice and gates in plain jnp (what the router kernel computes in one launch).

    logits [T, E] any float dtype; bias None, [E] or [T, E] (per token); returns (weights
    [T, K] float32, ids [T, K] int32). Arguments as `jax_moe_permute.route`, unchecked."""
    logits = logits.astype(jnp.float32)
    choice = jax.lax.stop_gradient(router_scores(logits, scoring))
    if bias is not None:
        choice = choice + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if num_groups is not None:
        choice = jnp.where(group_mask(choice, num_groups, topk_groups), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    ids = ids.astype(jnp.int32)
    weights = route_weights(logits, ids, scoring=scoring, renormalize=renormalize,
                            routed_scaling_factor=routed_scaling_factor)
    return weights, ids
