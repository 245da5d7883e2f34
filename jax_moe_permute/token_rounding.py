"""Tile-aware token rounding (opt-in): each expert's entry count rounded to a multiple of the
grouped GEMM's row tile, so that no tile of the expert MLP's GEMMs is partly padding.

Top-k routing leaves most groups a partial last tile: at T = 4096, DeepSeek-V3's 256 experts get
128 entries each on average and about a third of the MMA work of the 128-row tiles is padding.
Rounding, in the spirit of SonicMoE's token rounding, changes the routing instead of the kernel:

1. the top-k choice is made as usual; expert e gets c_e entries;
2. its count is rounded to a multiple n_e of the tile ("nearest", "up" or "down"; at most T);
3. expert e keeps its n_e best tokens: first those that chose it, by score, then (rounding up)
   the tokens that did not, by score. Ties go to the lower token index.

A dropped entry's id becomes -1 and its gate 0 (the other gates of the token are unchanged); an
added entry sits in one of `extra_slots` slots after the K top-k ones, with the gate its score
would have had among the token's top-k (the same renormalisation and scale). A token with more
added experts than slots keeps the best `extra_slots` (so that expert's count may miss its
multiple by those few). The choice carries no gradient; the gates are differentiable in the
logits as `route`'s are.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from . import reference
from .explicit_sharding import replicated, sharded_like
from .ops import static_int

MODES = ("nearest", "up", "down")


class TokenRounding(NamedTuple):
    """`route(..., token_rounding=TokenRounding(...))`.

    tile: rows per grouped-GEMM tile to round each expert's entries to (128: the training
        tiles of `ragged_dot` on sm_90).
    mode: "nearest" (a remainder of at least tile / 2 rounds up), "up" or "down".
    extra_slots: slots per token for the entries rounding up adds (Routing's ids and weights
        get K + extra_slots columns); None: K for "up", ceil(K / 2) for "nearest" (enough for
        every token at the bench's shapes: docs/layer.md), 0 for "down".
    """

    tile: int = 128
    mode: str = "nearest"
    extra_slots: Optional[int] = None


def check_token_rounding(rounding, top_k: int, where: str = "route") -> int:
    """The extra slots of a valid TokenRounding (0 for None); a clear error otherwise."""
    if rounding is None:
        return 0
    if not isinstance(rounding, TokenRounding):
        raise TypeError(f"{where}: token_rounding must be a TokenRounding or None, got {type(rounding).__name__}")
    static_int(rounding.tile, "token_rounding.tile", where)
    if rounding.mode not in MODES:
        raise ValueError(f"{where}: token_rounding.mode must be one of {MODES}, got {rounding.mode!r}")
    if rounding.extra_slots is None:
        return {"up": top_k, "nearest": (top_k + 1) // 2, "down": 0}[rounding.mode]
    return static_int(rounding.extra_slots, "token_rounding.extra_slots", where, minimum=0)


def rounded_counts(counts: jax.Array, tile: int, mode: str, tokens: int) -> jax.Array:
    """[E] int32 entry counts -> the rounded targets, at most `tokens` each."""
    if mode == "up":
        n = (counts + tile - 1) // tile
    elif mode == "down":
        n = counts // tile
    else:
        n = (counts + tile // 2) // tile
    return jnp.minimum(n * tile, tokens)


def round_routing(logits, weights, ids, rounding: TokenRounding, *, scoring: str, renormalize: bool,
                  routed_scaling_factor: float):
    """`route`'s (weights [T, K], ids [T, K]) of `logits` [T, E] -> rounded (weights [T, K + X],
    ids [T, K + X]); X = the extra slots. Arguments as `route`'s, checked there."""
    T, E = logits.shape
    K = ids.shape[1]
    extra = check_token_rounding(rounding, K)
    if T == 0:
        return (jnp.zeros((0, K + extra), jnp.float32), jnp.zeros((0, K + extra), jnp.int32))
    like = logits  # on an Explicit mesh: a sort along the tokens takes them unsplit, the results split back
    logits, weights, ids = (replicated(a) for a in (logits, weights, ids))
    scores = reference.router_scores(logits.astype(jnp.float32), scoring)
    order_scores = jax.lax.stop_gradient(scores)
    chosen = jnp.any(ids[:, :, None] == jnp.arange(E, dtype=ids.dtype), axis=1)  # [T, E]
    target = rounded_counts(jnp.sum(chosen, axis=0, dtype=jnp.int32), rounding.tile, rounding.mode, T)

    # Each expert's column ranked: chosen entries first (scores are in [0, 1]), each part by
    # score, ties to the lower token. A token is kept when it ranks at or before the column's
    # target-th, found by one stable key-value sort of each expert's row (key descending, the
    # tokens in ascending order as values: ties keep it), with no scatter.
    key = jnp.where(chosen, 2.0 + order_scores, order_scores).T  # [E, T]
    token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (E, T))
    neg_sorted, token_sorted = jax.lax.sort((-key, token), dimension=1, is_stable=True, num_keys=1)
    last = jnp.maximum(target - 1, 0)[:, None]
    last_key = -jnp.take_along_axis(neg_sorted, last, axis=1)
    last_token = jnp.take_along_axis(token_sorted, last, axis=1)
    keep = (((key > last_key) | ((key == last_key) & (token <= last_token))) & (target > 0)[:, None]).T

    kept = jnp.take_along_axis(keep, ids, axis=1)
    out_ids = [jnp.where(kept, ids, -1)]
    out_weights = [jnp.where(kept, weights, 0.0)]
    if extra:
        added = keep & ~chosen
        best, extra_ids = jax.lax.top_k(jnp.where(added, order_scores, -1.0), extra)
        live = best >= 0.0
        # The gate an added expert would have had among the token's top-k: its score under the
        # same renormalisation and scale.
        extra_w = jnp.take_along_axis(scores, extra_ids, axis=1)
        if renormalize:
            top = jnp.sum(jnp.take_along_axis(scores, ids, axis=1), axis=1, keepdims=True)
            extra_w = extra_w / (top + (1e-20 if scoring == "sigmoid" else 0.0))
        extra_w = extra_w * jnp.float32(routed_scaling_factor)
        out_ids.append(jnp.where(live, extra_ids.astype(jnp.int32), -1))
        out_weights.append(jnp.where(live, extra_w, 0.0))
    return (sharded_like(jnp.concatenate(out_weights, axis=1), like),
            sharded_like(jnp.concatenate(out_ids, axis=1), like))
