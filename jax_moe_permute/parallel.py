"""Expert parallelism over XLA collectives: `moe_ep`, called inside `jax.shard_map`.

Device d of the axis holds its own tokens and the experts [d*L, (d+1)*L), L = E / D. Two ways
to bring every routed token to its expert and the results back (both dropless, both exact):

  all_gather   gather every device's tokens, ids and weights; permute the entries routed to this
               device's experts (moe_permute with an expert_map), run them, unpermute the local
               weighted partial sums and psum_scatter them back to their owners.
  all_to_all   permute the local entries by global expert (so by destination device), send each
               device exactly its rows, regroup the received rows by local expert (moe_permute,
               K = 1), run them, undo that regrouping and send the results back along the same
               route; the owner applies the router weights in its moe_unpermute. XLA's
               ragged_all_to_all carries the rows where the backend implements it; elsewhere a
               dense all_to_all with worst-case (T*K rows per destination) blocks emulates it.

all_gather moves about (D-1)*T*(H+H') elements per device and layer, all_to_all about
T*K*(D-1)/D*(H+H') with uniform routing: all_to_all wins when K < D (docs/parallel.md).
"""

from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp

from . import ops
from ._compat import _pvary, pvary_to_match, varying_axes

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]
DISPATCHES = ("all_gather", "all_to_all", "ragged_all_to_all", "dense_all_to_all")
# Backends whose XLA implements ragged-all-to-all (XLA:CPU answers UNIMPLEMENTED).
RAGGED_ALL_TO_ALL_BACKENDS = ("gpu", "cuda", "rocm", "tpu")


def moe_ep(
    hidden: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    expert_fn: ExpertFn,
    *,
    num_experts: int,
    axis_name: Union[str, tuple],
    dispatch: str = "all_gather",
    align_size: int = 1,
) -> jax.Array:
    """Expert-parallel MoE: this device's tokens through experts spread over `axis_name`.

    Call inside `jax.shard_map` (any check_vma). With D = axis size and L = num_experts / D,
    this device (d = axis_index) computes the experts [d*L, (d+1)*L).

    Args:
      hidden: [T, H] this device's tokens (a moe_permute hidden dtype).
      topk_ids: [T, K] integer global expert ids; ids outside [0, E) contribute nothing.
      topk_weights: [T, K] float32, bfloat16 or float16 router weights.
      expert_fn: (rows [R, H], group_sizes [L] int32) -> [R, H'] this device's L experts on
        rows grouped by local expert (a closure over the local weight shards, e.g. two
        `jax.lax.ragged_dot`s). Rows past sum(group_sizes) are zero; their results are unused.
      num_experts: E, static, divisible by the axis size.
      axis_name: the mesh axis (or tuple of axes) the experts are spread over.
      dispatch: "all_gather" (default), or "all_to_all": ragged_all_to_all where
        jax.default_backend() implements it (GPU, TPU), a dense all_to_all with worst-case
        buffers elsewhere; "ragged_all_to_all" / "dense_all_to_all" force one of the two.
      align_size: A, static: each local expert's block given to expert_fn is padded with zero
        rows to a multiple of A.

    Returns [T, H'] in expert_fn's output dtype: out[t] = sum_k w[t,k] * expert_{id[t,k]}(hidden[t]),
    the single-device result. Differentiable in hidden, topk_weights and whatever expert_fn
    closes over; composes with jit, grad, checkpoint and scan.
    """
    op = "moe_ep"
    ops._check_array(hidden, "hidden", op, 2, "[T, H]")
    ops._check_array(topk_ids, "topk_ids", op, 2, "[T, K]")
    ops._check_array(topk_weights, "topk_weights", op, 2, "[T, K]")
    ops.check_float(hidden, "hidden", op, ops.HIDDEN_DTYPES)
    ops.check_int(topk_ids, "topk_ids", op)
    ops.check_float(topk_weights, "topk_weights", op, ops.WEIGHT_DTYPES)
    if topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must be [T, H], [T, K], [T, K]")
    num_experts = ops.static_int(num_experts, "num_experts", op)
    align_size = ops.static_int(align_size, "align_size", op)
    if not callable(expert_fn):
        raise TypeError(f"{op}: expert_fn must be callable (rows [R, H], group_sizes [L]) -> [R, H']")
    if dispatch not in DISPATCHES:
        raise ValueError(f"{op}: dispatch must be one of {', '.join(map(repr, DISPATCHES))}, got {dispatch!r}")
    num_devices = jax.lax.axis_size(axis_name)  # raises NameError for an axis not in scope
    if num_experts % num_devices:
        raise ValueError(f"{op}: num_experts ({num_experts}) must be divisible by the size of axis "
                         f"{axis_name!r} ({num_devices})")
    num_local = num_experts // num_devices

    # These are this device's own tokens: mark them varying along the axis (a no-op for
    # sharded inputs; a replicated input then gets its gradient summed over the axis).
    hidden, topk_ids, topk_weights = _varying_along(axis_name, hidden, topk_ids, topk_weights)
    topk_ids = ops.to_int32(topk_ids)
    if topk_ids.size == 0:  # no entries anywhere (shard_map shards evenly): nothing to send
        y = _run_experts(expert_fn, jnp.zeros((0, hidden.shape[1]), hidden.dtype), jnp.zeros(num_local, jnp.int32))
        return pvary_to_match(jnp.zeros((hidden.shape[0], y.shape[1]), y.dtype), hidden)[0]
    if dispatch == "all_to_all":
        dispatch = "ragged_all_to_all" if jax.default_backend() in RAGGED_ALL_TO_ALL_BACKENDS else "dense_all_to_all"
    if dispatch == "all_gather":
        return _all_gather_dispatch(hidden, topk_ids, topk_weights, expert_fn, num_experts, num_local,
                                    axis_name, align_size)
    return _all_to_all_dispatch(hidden, topk_ids, topk_weights, expert_fn, num_experts, num_local, axis_name,
                                align_size, ragged=dispatch == "ragged_all_to_all")


def _varying_along(axis_name, *xs):
    axes = frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    out = []
    for x in xs:
        missing = axes - varying_axes(jax.typeof(x))
        out.append(_pvary(x, sorted(missing)) if missing else x)
    return tuple(out)


def _run_experts(expert_fn, rows, group_sizes):
    y = expert_fn(rows, group_sizes)
    if getattr(y, "ndim", None) != 2 or y.shape[0] != rows.shape[0]:
        raise ValueError(f"moe_ep: expert_fn must map rows {tuple(rows.shape)} to [{rows.shape[0]}, H'], "
                         f"got {getattr(y, 'shape', type(y).__name__)}")
    return y


def _sum_dtype(dtype):
    """The dtype partial sums travel in: the expert output's, float32 for float8."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 2 else jnp.dtype(jnp.float32)


def _all_gather_dispatch(hidden, topk_ids, topk_weights, expert_fn, num_experts, num_local, axis_name,
                         align_size):
    gather = lambda x: jax.lax.all_gather(x, axis_name, tiled=True)  # noqa: E731
    all_hidden, all_ids, all_weights = gather(hidden), gather(topk_ids), gather(topk_weights)  # [D*T, ...]
    first = jax.lax.axis_index(axis_name) * num_local
    # Global expert -> local index; other devices' experts land outside [0, L) and are dropped.
    expert_map = jnp.arange(num_experts, dtype=jnp.int32) - first
    all_hidden, all_ids, expert_map = pvary_to_match(all_hidden, all_ids, expert_map)
    res = ops.moe_permute(all_hidden, all_ids, num_experts, expert_map=expert_map, num_local_experts=num_local,
                          align_size=align_size)
    y = _run_experts(expert_fn, res.hidden, res.group_sizes)
    y, row_map, all_weights = pvary_to_match(y, res.row_map, all_weights)
    partial = ops.moe_unpermute(y, row_map, all_weights, out_dtype=_sum_dtype(y.dtype))  # [D*T, H']
    out = jax.lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
    return out.astype(y.dtype)


def _all_to_all_dispatch(hidden, topk_ids, topk_weights, expert_fn, num_experts, num_local, axis_name,
                         align_size, ragged):
    num_devices = num_experts // num_local
    entries = topk_ids.size  # N = T*K: rows of the sorted buffer and the worst case per destination
    d = jax.lax.axis_index(axis_name)

    # Sender: rows sorted by global expert are sorted by destination device.
    sent = ops.moe_permute(hidden, topk_ids, num_experts)  # hidden [N, H], group_sizes [E]
    all_sizes = jax.lax.all_gather(sent.group_sizes, axis_name, tiled=False)  # [D(source), E]
    counts = all_sizes.reshape(num_devices, num_devices, num_local)  # [source, destination, local expert]
    sends = counts.sum(-1)  # [source, destination] rows
    send_offsets = jnp.cumsum(sends, axis=1) - sends  # where each block starts in its source's buffer
    recv_offsets = jnp.cumsum(sends, axis=0) - sends  # where each block lands in its destination's buffer
    mine = lambda x: jnp.take(x, d, axis=0)  # noqa: E731
    mine_t = lambda x: jnp.take(x, d, axis=1)  # noqa: E731
    outbound = (mine(send_offsets), mine(sends), mine(recv_offsets), mine_t(sends))
    inbound = (mine_t(recv_offsets), mine_t(sends), mine_t(send_offsets), mine(sends))

    # Receiver: source s's rows arrive sorted by local expert; recover each row's local expert
    # from the gathered counts instead of sending ids along.
    recv_rows = num_devices * entries
    recv = _exchange(sent.hidden, recv_rows, *outbound, axis_name=axis_name, cap=entries, ragged=ragged)
    segments = mine_t(counts).reshape(-1)  # rows of (source, local expert), in arrival order
    segments = jnp.append(segments, recv_rows - segments.sum())  # and the unused tail: id -1
    segment_ids = jnp.append(jnp.arange(num_devices * num_local, dtype=jnp.int32) % num_local, -1)
    local_ids = jnp.repeat(segment_ids, segments, total_repeat_length=recv_rows)[:, None]
    recv, local_ids = pvary_to_match(recv, local_ids)
    grouped = ops.moe_permute(recv, local_ids, num_local, align_size=align_size)
    y = _run_experts(expert_fn, grouped.hidden, grouped.group_sizes)
    y, grouped_map = pvary_to_match(y, grouped.row_map)
    back = ops.moe_unpermute(y, grouped_map)  # [D*N, H'] in arrival order

    # Return trip along the mirrored route, into the sender's sorted layout.
    returned = _exchange(back, entries, *inbound, axis_name=axis_name, cap=entries, ragged=ragged)
    returned, row_map, topk_weights = pvary_to_match(returned, sent.row_map, topk_weights)
    return ops.moe_unpermute(returned, row_map, topk_weights)


def _exchange(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, cap,
              ragged):
    """`jax.lax.ragged_all_to_all` into a zero [out_rows, ...] buffer, or its emulation by a
    dense all_to_all of blocks of `cap` rows (cap >= every send size)."""
    output = jnp.zeros((out_rows,) + operand.shape[1:], operand.dtype)
    sizes = [x.astype(jnp.int32) for x in (input_offsets, send_sizes, output_offsets, recv_sizes)]
    if ragged:
        operand, output, *sizes = pvary_to_match(operand, output, *sizes)
        return jax.lax.ragged_all_to_all(operand, output, *sizes, axis_name=axis_name)
    input_offsets, send_sizes, output_offsets, recv_sizes = sizes
    i = jnp.arange(cap, dtype=jnp.int32)
    # Block j: operand[input_offsets[j] : + send_sizes[j]], zero-padded to cap rows.
    source = jnp.where(i < send_sizes[:, None], input_offsets[:, None] + i, -1).reshape(-1)
    blocks = _take_rows(operand, source)  # [D*cap, ...]
    blocks = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block s now from source s
    # Where source s wanted its block written here (its output_offsets entry for this device).
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = jnp.where(i < recv_sizes[:, None], landing[:, None] + i, out_rows).reshape(-1)
    output, blocks = pvary_to_match(output, blocks)
    return output.at[target].set(blocks, mode="drop")


def _take_rows(x, rows):
    """x[rows] with zeros where rows is -1."""
    if x.shape[0] == 0:
        return jnp.zeros((rows.shape[0],) + x.shape[1:], x.dtype)
    taken = jnp.take(x, jnp.maximum(rows, 0), axis=0)
    keep = (rows >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(keep, taken, jnp.zeros((), x.dtype))
