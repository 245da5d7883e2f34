"""Explicit sharding (mesh axes of type Explicit, `jax.make_mesh`'s default): an array's sharding
is part of its type, so jax asks every op for its result's sharding. Our calls take their operands
split along the batch axis only (`batch_axis.bind_operands`), and the layer, whose tokens are
independent of each other, runs on each device's own tokens (`over_token_shards`). Elsewhere
(Auto axes, one device) every function here returns its input as it is."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import AxisType, PartitionSpec


def over_token_shards(fn: Callable, per_token: Sequence, shared: Sequence):
    """fn(*per_token, *shared) with each device running it on its own tokens: per_token arrays
    [T, ...] (None allowed) split along T as the first one is over Explicit mesh axes, and shared
    arrays (None allowed) replicated, in a `jax.shard_map` manual over those axes only (the
    shared arrays' cotangents are summed over them). For a token-wise fn, such as the MoE layer
    with its weights, this is data parallelism with no collective in the forward pass. Elsewhere,
    or where the tokens are not split, one call of fn."""
    aval = jax.typeof(per_token[0])
    split = aval.sharding.spec[0] if on_explicit_mesh(aval) and aval.ndim else None
    if split is None:
        return fn(*per_token, *shared)
    token_spec = lambda a: (split,) + (None,) * (a.ndim - 1)
    args = [a if a is None else resharded(a, token_spec(a), aval.sharding) for a in per_token]
    args += [a if a is None else resharded(a, (None,) * a.ndim, aval.sharding) for a in shared]
    live = [i for i, a in enumerate(args) if a is not None]

    def local(*arrays):
        full = [None] * len(args)
        for i, a in zip(live, arrays):
            full[i] = a
        return fn(*full)

    specs = [PartitionSpec(*token_spec(args[i])) if i < len(per_token) else PartitionSpec() for i in live]
    axes = set(split) if isinstance(split, tuple) else {split}
    out_spec = PartitionSpec(split)
    return jax.shard_map(local, mesh=aval.sharding.mesh, in_specs=tuple(specs), out_specs=out_spec,
                         axis_names=axes)(*(args[i] for i in live))


def replicated(x):
    """x, replicated first where it is sharded along Explicit mesh axes (for jnp code whose
    output sharding jax cannot infer, such as a scatter indexed by a sharded array)."""
    aval = jax.typeof(x)
    return resharded(x, (None,) * aval.ndim) if sharded_explicitly(aval) else x


def sharded_like(out, x):
    """A token-wise result `out` [T, ...] in the sharding of its input x [T, ...] on a mesh with
    Explicit axes (our calls return it replicated there); the trailing axes keep x's sharding where
    their extents agree. Elsewhere `out` as it is."""
    a, b = jax.typeof(out), jax.typeof(x)
    if not on_explicit_mesh(b) or a.ndim != b.ndim:
        return out
    return resharded(out, [s if i == 0 or a.shape[i] == b.shape[i] else None for i, s in enumerate(b.sharding.spec)])


def resharded(x, spec, like=None):
    """x with PartitionSpec(*spec) on the mesh of `like` (a sharding; default x's own, which is
    empty for an array made outside the mesh): `jax.reshard` where it differs."""
    sharding = jax.typeof(x).sharding
    if tuple(sharding.spec) == tuple(spec):
        return x
    return jax.reshard(x, (like or sharding).update(spec=PartitionSpec(*spec)))


def on_explicit_mesh(aval) -> bool:
    """Whether `aval` lives on a mesh with Explicit axes (its sharding is part of its type)."""
    sharding = getattr(aval, "sharding", None)
    return any(t == AxisType.Explicit for t in getattr(getattr(sharding, "mesh", None), "axis_types", ()))


def sharded_explicitly(aval) -> bool:
    """Whether `aval` is sharded along an axis of such a mesh."""
    return on_explicit_mesh(aval) and any(s is not None for s in aval.sharding.spec)
