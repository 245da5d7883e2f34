"""The leading batch axis every primitive of the package carries.

Each operand has a leading axis of extent B (the batch) or 1 (broadcast: the kernels read it
with batch stride 0). The public ops add it with B = 1; `vmap` folds its axis into it, so a
vmapped call stays one custom call; a cotangent of a broadcast operand sums over the batch.
Under explicit sharding the batch axis is the only one a call's operands and results are
sharded along (`bind_operands`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from ._compat import pvary_to_match
from .explicit_sharding import resharded, sharded_explicitly


def batch_extent(*avals) -> int:
    """B, checking that every operand's leading extent is B or 1."""
    sizes = {a.shape[0] for a in avals}
    batch = max(sizes)
    if not sizes <= {1, batch}:
        raise ValueError(f"jax_moe_permute: inconsistent batch extents {sorted(sizes)}")
    return batch


def bind_operands(*xs, batched=True):
    """The operands of one primitive bind: varying alike under shard_map (`pvary_to_match`), and
    under explicit sharding (mesh axes of type Explicit, `jax.make_mesh`'s default) sharded along
    the leading batch axis only, as the first batched operand of full extent is, or along no
    axis: every other axis is replicated before the call (its transpose returns each cotangent in
    its operand's sharding), as sharded jit's partitioner does under Auto axes, since a token's
    rows may land anywhere in a permuted buffer. `batched`: whether the operands' leading axes
    are that batch axis, one bool for all or one per operand. The results' avals follow
    (`_compat.shaped_like`). Without explicit axes nothing changes."""
    xs = pvary_to_match(*xs)
    avals = [jax.typeof(x) for x in xs]
    if not any(sharded_explicitly(a) for a in avals):
        return xs
    flags = [batched] * len(xs) if isinstance(batched, bool) else list(batched)
    flags = [f and a.ndim > 0 for f, a in zip(flags, avals)]
    full = max((a.shape[0] for a, f in zip(avals, flags) if f), default=0)
    lead = next((a.sharding.spec[0] for a, f in zip(avals, flags) if f and a.shape[0] == full), None)
    like = next(a.sharding for a in avals if sharded_explicitly(a))
    specs = [((lead if f and a.shape[0] == full else None,) + (None,) * (a.ndim - 1)) if a.ndim else ()
             for a, f in zip(avals, flags)]
    return tuple(resharded(x, spec, like) for x, spec in zip(xs, specs))


def fold_vmap_axis(args, dims):
    """Moves each vmapped axis to the front and merges it with the leading batch axis (an
    operand not vmapped and of batch extent 1 stays broadcast: no copy). Returns the folded
    operands and the vmapped extent V."""
    V = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    B = max(a.shape[0] if d is None else a.shape[1] for a, d in zip(moved, dims))
    folded = []
    for a, d in zip(moved, dims):
        if d is None and (a.shape[0] == 1 or V == 1):
            folded.append(a)
            continue
        if d is None:
            a = jnp.broadcast_to(a[None], (V,) + a.shape)
        elif a.shape[1] != B:  # nested vmap: batched here, broadcast inside
            a = jnp.broadcast_to(a, (V, B) + a.shape[2:])
        folded.append(a.reshape((V * B,) + a.shape[2:]))
    return folded, V


def batcher(p):
    """The batching rule of primitive `p`: one bind over the folded batch."""

    def rule(args, dims, **params):
        folded, V = fold_vmap_axis(args, dims)
        out = p.bind(*folded, **params)
        unfold = lambda o: o.reshape((V, o.shape[0] // V) + o.shape[1:])
        if p.multiple_results:
            return [unfold(o) for o in out], [0] * len(out)
        return unfold(out), 0

    return rule


def sum_to_batch(ct, operand):
    """The cotangent of an operand broadcast over the batch (extent 1) sums over it."""
    shape = operand.aval.shape if ad.is_undefined_primal(operand) else operand.shape
    if shape[0] == 1 and ct.shape[0] != 1:
        ct = jnp.sum(ct, axis=0, keepdims=True, dtype=jnp.float32).astype(ct.dtype)
    return ct
