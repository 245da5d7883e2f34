"""The public operations: rank/dtype checks, static parameters, binding the primitives.

Shape consistency (T, expert_map, weights, the row bound) is checked once, in the
primitives' abstract evaluation."""

from __future__ import annotations

import operator
from typing import Optional

import jax
import jax.numpy as jnp

from . import primitives
from .reference import PermuteResult, to_int32

HIDDEN_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)))
WEIGHT_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))


def _names(dtypes):
    return ", ".join(d.name for d in dtypes)


def _check_array(x, name: str, op: str, ndim: int, shape_doc: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have shape {shape_doc}, got shape {tuple(x.shape)}")


def check_float(x, name: str, op: str, dtypes):
    if jnp.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {jnp.dtype(x.dtype).name}; supported dtypes: {_names(dtypes)}")


def check_int(x, name: str, op: str):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{op}: {name} must have an integer dtype, got {jnp.dtype(x.dtype).name}")


def static_int(value, name: str, op: str, minimum: int = 1) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} must be a static Python int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    return value


def check_layer(layer, stacks, where: str):
    """An int32 scalar layer index, and stacks (name, array) with one leading layer dimension of
    equal size; clear errors naming the argument otherwise."""
    if not hasattr(layer, "dtype"):
        layer = jnp.asarray(layer)
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"{where}: layer must be an integer scalar, got {jnp.shape(layer)} {layer.dtype}")
    sizes = set()
    for name, w in stacks:
        if not hasattr(w, "shape") or w.ndim < 2:
            raise ValueError(f"{where}: with layer, {name} must be stacked over the layers ([NL, ...]), "
                             f"got {getattr(w, 'shape', type(w))}")
        sizes.add(w.shape[0])
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"{where}: with layer, " + " and ".join(n for n, _ in stacks) +
                         f" must stack the same number (>= 1) of layers, got {[tuple(w.shape) for _, w in stacks]}")
    return layer.astype(jnp.int32)


def layer_weights(w, layer):
    """w[layer] of a stack over a model's layers, as the kernels read it (negative from the end,
    then clamped: lax.dynamic_index_in_dim); w itself without a layer, None for None."""
    return w if w is None or layer is None else jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)


def moe_permute(
    hidden: jax.Array,
    topk_ids: jax.Array,
    num_experts: int,
    *,
    expert_map: Optional[jax.Array] = None,
    num_local_experts: Optional[int] = None,
    align_size: int = 1,
) -> PermuteResult:
    """Gathers each token's row to the K experts it is routed to, grouped by local expert.

    Args:
      hidden: [T, H] float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (copied bit-exactly).
      topk_ids: [T, K] any integer dtype: the global expert of each of a token's K slots.
      num_experts: E, static int >= 1.
      expert_map: optional [E] integer array mapping a global expert to its local index in
        [0, L) or to -1 when the expert is not on this device (traced).
      num_local_experts: L, static; required with expert_map.
      align_size: A, static int >= 1; every local expert's block is padded with zero rows to
        a multiple of A.

    An entry is dropped when its id is outside [0, E) or maps outside [0, L).
    Returns a PermuteResult with hidden [R, H], group_sizes [L] and row_map [T, K], where
    R = T*K when A = 1, else floor((T*K + min(T*K, L)*(A-1)) / A) * A.
    """
    op = "moe_permute"
    _check_array(hidden, "hidden", op, 2, "[T, H]")
    _check_array(topk_ids, "topk_ids", op, 2, "[T, K]")
    check_float(hidden, "hidden", op, HIDDEN_DTYPES)
    check_int(topk_ids, "topk_ids", op)
    num_experts = static_int(num_experts, "num_experts", op)
    align_size = static_int(align_size, "align_size", op)
    if expert_map is None:
        if num_local_experts is not None and static_int(num_local_experts, "num_local_experts", op) != num_experts:
            raise ValueError(f"{op}: num_local_experts ({num_local_experts}) without expert_map must equal "
                             f"num_experts ({num_experts})")
        num_local, map_operand = num_experts, primitives.placeholder(2, jnp.int32)
    else:
        if num_local_experts is None:
            raise ValueError(f"{op}: num_local_experts is required when expert_map is given")
        num_local = static_int(num_local_experts, "num_local_experts", op)
        _check_array(expert_map, "expert_map", op, 1, f"({num_experts},)")
        check_int(expert_map, "expert_map", op)
        map_operand = to_int32(expert_map)[None]
    rows, group_sizes, row_map = primitives.permute(
        jnp.asarray(hidden)[None], to_int32(topk_ids)[None], map_operand, num_experts=num_experts,
        num_local_experts=num_local, align_size=align_size, has_map=expert_map is not None)
    return PermuteResult(rows[0], group_sizes[0], row_map[0])


def moe_unpermute(
    expert_out: jax.Array,
    row_map: jax.Array,
    topk_weights: Optional[jax.Array] = None,
    *,
    out_dtype=None,
    residual: Optional[jax.Array] = None,
) -> jax.Array:
    """Sums each token's K expert outputs, weighted by the router's top-k weights.

    Args:
      expert_out: [R, H'] float32, bfloat16, float16, float8_e4m3fn or float8_e5m2.
      row_map: [T, K] integer: the row of expert_out holding entry (t, k); entries outside
        [0, R) contribute nothing.
      topk_weights: [T, K] float32, bfloat16 or float16, or None meaning 1.
      out_dtype: result dtype, default expert_out.dtype (residual's dtype where it is given).
      residual: optional [T, H'] of out_dtype added to the result (a decoder block's
        `x + moe(x)`), bit for bit the add after the op; on CUDA in the unpermute's launch.

    Returns out [T, H'] with out[t] = sum_k w[t,k] * expert_out[row_map[t,k]], accumulated
    in float32 in ascending k (no atomics: bitwise reproducible).
    """
    op = "moe_unpermute"
    _check_array(expert_out, "expert_out", op, 2, "[R, H]")
    _check_array(row_map, "row_map", op, 2, "[T, K]")
    check_float(expert_out, "expert_out", op, HIDDEN_DTYPES)
    check_int(row_map, "row_map", op)
    if topk_weights is not None:
        _check_array(topk_weights, "topk_weights", op, 2, "[T, K]")
        check_float(topk_weights, "topk_weights", op, WEIGHT_DTYPES)
        weights = jnp.asarray(topk_weights)[None]
    else:
        weights = primitives.placeholder(3)
    if residual is not None and not (hasattr(residual, "shape") and hasattr(residual, "dtype")):
        raise ValueError(f"{op}: residual must be an array [T, H'], got {type(residual).__name__}")
    if out_dtype is None:
        out_dtype = expert_out.dtype if residual is None else residual.dtype
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in HIDDEN_DTYPES:
        raise TypeError(f"{op}: out_dtype {out_dtype.name} is not supported; supported dtypes: "
                        f"{_names(HIDDEN_DTYPES)}")
    args = (jnp.asarray(expert_out)[None], to_int32(row_map)[None], weights)
    has_weights = topk_weights is not None
    if residual is not None:
        want = (row_map.shape[0], expert_out.shape[1])
        if tuple(residual.shape) != want or residual.dtype != out_dtype:
            raise ValueError(f"{op}: residual must have shape {want} and dtype {out_dtype.name} (out_dtype), got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if out_dtype in map(jnp.dtype, primitives.KERNEL_OUT_DTYPES):  # float8 takes the add after the op
            return primitives.unpermute_add(*args, jnp.asarray(residual)[None], has_weights=has_weights)[0]
    out = primitives.unpermute(*args, out_dtype, has_weights=has_weights)[0]
    return out if residual is None else out + residual
