"""`ragged_dot`: jax.lax.ragged_dot's contract on our CUTLASS grouped GEMM (sm_90), a drop-in.

Where the kernels do not apply (CPU, GPUs other than sm_90, float32 or mixed input dtypes, an
output dtype other than the input's, K or N not a multiple of 8, group_offset) the same
primitives lower to jax.lax.ragged_dot, so transformations behave the same everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .batch_axis import bind_operands
from .explicit_sharding import on_explicit_mesh, replicated
from .gemm_primitives import kernels_available, ragged_dot_bind, ragged_dot_stacked_p

__all__ = ["ragged_dot", "kernels_available", "TILES", "DECODE_TILE"]

# The kernels' tiles (output rows x columns per CTA, cpp/gemm/grouped_gemm.h), chosen per call by the
# problem's shape. The environment variables MOE_GROUPED_GEMM_TILE and MOE_GROUPED_GEMM_DW_TILE,
# read at every call, force one of them on the forward and d lhs GEMMs, and on the weight
# gradient (to measure or test it); any other value is an error.
TILES = ("128x256", "64x256", "128x128")
# The forward GEMM's decode kernel (CUDA cores streaming the weights, graph-safe; chosen while
# groups average at most gemm_primitives.DECODE_ROWS_PER_GROUP rows): MOE_GROUPED_GEMM_TILE=decode
# forces it on the forward GEMM, a CUTLASS tile name forces CUTLASS there; unlike the tiles this is
# read when a call is lowered (a jitted function keeps the choice it was compiled with).
DECODE_TILE = "decode"

_PRIMITIVE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check(lhs, rhs, group_sizes) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"ragged_dot: lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"ragged_dot: rhs must be [G, K, N], got shape {rhs.shape}")
    if group_sizes.ndim != 1:
        raise ValueError(f"ragged_dot: group_sizes must be [G], got shape {group_sizes.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"ragged_dot: lhs [M, K] = {lhs.shape} and rhs [G, K, N] = {rhs.shape} "
                         "disagree on K")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"ragged_dot: group_sizes has {group_sizes.shape[0]} groups, rhs {rhs.shape[0]}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"ragged_dot: group_sizes must be integer, got {group_sizes.dtype}")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"ragged_dot: {name} must be floating point, got {x.dtype}")


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision=None,
               preferred_element_type=None, group_offset: jax.Array | None = None) -> jax.Array:
    """Grouped matrix product, `jax.lax.ragged_dot`'s contract.

    Args:
      lhs: [M, K]; rows [start_g, start_g + group_sizes[g]) form group g, start_g the sum of
        earlier sizes.
      rhs: [G, K, N], one matrix per group.
      group_sizes: [G] integer. Rows past sum(group_sizes) give zero output rows.
      precision: as for jax.lax.ragged_dot (used where it lowers to it; the bf16/f16 kernels
        always multiply in the input dtype and accumulate in float32).
      preferred_element_type: the output dtype; default the (common) input dtype.
      group_offset: not supported by the kernels: the call goes to jax.lax.ragged_dot.

    Returns:
      [M, N] of dtype `preferred_element_type` (default the input dtype).

    On sm_90 GPUs, bfloat16 and float16 inputs with an output of the same dtype and K, N
    multiples of 8 run our CUTLASS grouped GEMM (forward and both gradients); everything else
    lowers to jax.lax.ragged_dot through the same primitives.
    """
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes)
    if group_offset is not None or lhs.dtype != rhs.dtype or lhs.dtype not in _PRIMITIVE_DTYPES:
        avals = [jax.typeof(a) for a in (lhs, rhs, group_sizes)]
        out_sharding = next((a.sharding for a in avals if on_explicit_mesh(a)), None)
        if out_sharding is not None:  # as our primitive: operands and result replicated
            lhs, rhs, group_sizes = (replicated(a) for a in (lhs, rhs, group_sizes))
            out_sharding = out_sharding.update(spec=jax.sharding.PartitionSpec(None, None))
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                  preferred_element_type=preferred_element_type, group_offset=group_offset,
                                  out_sharding=out_sharding)
    out_dtype = jnp.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    out = ragged_dot_bind(lhs[None], rhs[None], group_sizes.astype(jnp.int32)[None], rhs_transposed=False,
                          out_dtype=out_dtype, precision=_hashable(precision))
    return out[0]


def ragged_dot_stacked(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, layer) -> jax.Array:
    """`ragged_dot(lhs, rhs[layer], group_sizes)` for rhs [NL, G, K, N] stacked over a model's
    layers and an int32 scalar layer: on sm_90 the kernel reads the layer on the device
    (gemm_primitives.ragged_dot_stacked_p); inputs of one dtype, output in it."""
    operands = bind_operands(lhs[None], rhs, group_sizes.astype(jnp.int32)[None],
                             jnp.asarray(layer, jnp.int32).reshape(()), batched=(True, False, True, False))
    return ragged_dot_stacked_p.bind(*operands)[0]


def _hashable(precision):
    """Primitive parameters must hash: lists of precisions become tuples."""
    if isinstance(precision, list):
        return tuple(precision)
    return precision

