"""Lowering of the primitives: to our XLA FFI targets on the platforms that have them, and
through the plain-jnp reference elsewhere.

Sharded `jax.jit`: each kernel call is wrapped in `custom_partitioning` below the
differentiable primitive (autodiff and vmap rules act on the primitive; partitioning happens
in its lowering), so the leading batch axis partitions: every device runs the kernel on its
own batch slice, with no collective, and the outputs keep that sharding. Every other axis is
replicated before the call (XLA gathers it): a token's rows, its K choices and the expert
rows it reads may live anywhere in the global arrays."""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from . import _native, reference
from ._compat import lowers_for_many_devices


# ---- our kernels ------------------------------------------------------------------------

def kernel_rule(op: str, platform: str, abstract_eval: Callable, attrs: Sequence[str] = (),
                workspace: Optional[Callable] = None):
    """The lowering rule calling FFI target `op` of `platform`.

    attrs: the static parameters passed to the handler as int64 attributes.
    workspace: (in_avals, out_avals) -> sizes for `_native.workspace_bytes`; the handler then
      gets one more uint8 result of that many bytes, which the call drops.
    """
    target = _native.target(op)

    def call(params, *arrays):
        # Shapes are the local ones when the call is partitioned.
        in_avals = [jax.typeof(a) for a in arrays]
        out_avals = abstract_eval(*in_avals, **params)
        multiple = isinstance(out_avals, (tuple, list))
        out_avals = list(out_avals) if multiple else [out_avals]
        result_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
        if workspace is not None:
            nbytes = _native.workspace_bytes(platform, op, *workspace(in_avals, out_avals))
            result_types.append(jax.ShapeDtypeStruct((max(nbytes, 1),), jnp.uint8))
        results = jax.ffi.ffi_call(target, result_types)(*arrays, **{k: np.int64(params[k]) for k in attrs})
        results = results[:len(out_avals)]
        return tuple(results) if multiple else results[0]

    def rule(ctx, *args, **params):
        multiple = len(ctx.avals_out) > 1
        fn = lambda *arrays: call(params, *arrays)
        if lowers_for_many_devices(ctx):
            fn = _batch_partitioned(fn, ctx.avals_in, ctx.avals_out)
        return mlir.lower_fun(fn, multiple_results=multiple)(ctx, *args)

    return rule


def _batch_partitioned(fn: Callable, in_avals, out_avals) -> Callable:
    """`fn` wrapped so that the SPMD partitioner splits it along the leading batch axis only.

    Operands of batch extent 1 (broadcast) are replicated; all outputs have the full extent."""
    B = max(a.shape[0] for a in in_avals)
    batched = [a.shape[0] == B for a in in_avals]
    multiple = len(out_avals) > 1

    def batch_axes(mesh, arg_shapes):
        """The mesh axes of the first batched operand's leading dimension."""
        for shape, is_batched in zip(arg_shapes, batched):
            sharding = shape.sharding
            if is_batched and isinstance(sharding, NamedSharding) and len(sharding.spec):
                return sharding.spec[0]
        return None

    def result_shardings(mesh, axes):
        shardings = [NamedSharding(mesh, PartitionSpec(axes)) for _ in out_avals]
        return tuple(shardings) if multiple else shardings[0]

    def infer(mesh, arg_shapes, result_shape):
        return result_shardings(mesh, batch_axes(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        axes = batch_axes(mesh, arg_shapes)
        arg_shardings = tuple(NamedSharding(mesh, PartitionSpec(axes) if b else PartitionSpec())
                              for b in batched)
        return mesh, fn, result_shardings(mesh, axes), arg_shardings

    # Shardy: the batch factor `b` is shared by the batched operands and every result; every
    # other dimension is a factor of its own that must stay replicated.
    names = (f"d{i}" for i in itertools.count())
    others = []

    def factors(aval, lead_is_batch):
        dims = ["b" if lead_is_batch else next(names)] + [next(names) for _ in aval.shape[1:]]
        others.extend(d for d in dims if d != "b")
        return " ".join(dims)

    rule = (", ".join(factors(a, b) for a, b in zip(in_avals, batched)) + " -> "
            + ", ".join(factors(a, True) for a in out_avals))
    wrapped = custom_partitioning(fn)
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                          need_replication_factors=tuple(others))
    return wrapped


# ---- platforms without our kernels: the jnp reference ----------------------------------

def _per_example(fn, args):
    """Applies single-example `fn` over the leading batch axis, broadcasting extent-1 operands."""
    B = max(a.shape[0] for a in args)
    if B == 1:
        outs = fn(*[a[0] for a in args])
        return jax.tree.map(lambda o: o[None], outs)
    axes = tuple(0 if a.shape[0] == B else None for a in args)
    args = [a if ax == 0 else a[0] for a, ax in zip(args, axes)]
    return jax.vmap(fn, in_axes=axes)(*args)


def reference_permute(hidden, ids, expert_map, *, num_experts, num_local_experts, align_size, has_map):
    def one(h, i, m):
        return tuple(reference.moe_permute(h, i, num_experts, expert_map=m if has_map else None,
                                           num_local_experts=num_local_experts, align_size=align_size))
    return list(_per_example(one, [hidden, ids, expert_map]))


def reference_unpermute(x, row_map, weights, *, out_dtype, has_weights):
    return _per_example(lambda a, r, w: reference.moe_unpermute(a, r, w if has_weights else None,
                                                                out_dtype=out_dtype), [x, row_map, weights])


def reference_scatter(x, row_map, weights, *, num_rows, out_dtype, has_weights):
    def one(a, r, w):
        w = jnp.ones(r.shape, jnp.float32) if not has_weights else w.astype(jnp.float32)
        valid = (r >= 0) & (r < num_rows)
        contrib = a.astype(jnp.float32)[:, None, :] * jnp.where(valid, w, 0.0)[..., None]
        out = jnp.zeros((num_rows, a.shape[1]), jnp.float32).at[jnp.where(valid, r, num_rows)].add(
            contrib, mode="drop")
        return out.astype(out_dtype)
    return _per_example(one, [x, row_map, weights])


def reference_weight_grad(c, x, row_map, *, out_dtype):
    def one(ct, a, r):
        valid = (r >= 0) & (r < a.shape[0])
        rows = jnp.take(a, jnp.where(valid, r, 0), axis=0).astype(jnp.float32)
        dots = jnp.sum(rows * ct.astype(jnp.float32)[:, None, :], axis=-1)
        return jnp.where(valid, dots, 0.0).astype(out_dtype)
    return _per_example(one, [c, x, row_map])
