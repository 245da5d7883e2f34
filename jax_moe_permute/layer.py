"""The routed expert MLP, functional: permute -> grouped matmul -> activation -> grouped matmul ->
weighted unpermute. The Flax modules (nnx.py, linen.py) are thin wrappers over this file and
routing.py."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jax.custom_derivatives import SymbolicZero

from . import decode_mlp, down_backward, gather_gemm, ops, primitives
from .explicit_sharding import over_token_shards, resharded, sharded_like
from .grouped_gemm import ragged_dot, ragged_dot_stacked
from .router_kernel import router_logits  # noqa: F401 - re-exported: layer.router_logits
from .routing import check_routing_args
from .token_rounding import check_token_rounding

# name: (activation applied to the gate half, gated). Gated ones split w_in's output into
# [gate | up] halves (HF's gate_proj / w1 first) and compute act(gate) * up.
ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    "swiglu": (jax.nn.silu, True),
    "geglu": (lambda x: jax.nn.gelu(x, approximate=False), True),  # torch's / HF's "gelu" is the erf form
    "gelu": (lambda x: jax.nn.gelu(x, approximate=False), False),
    "relu": (jax.nn.relu, False),
}


def check_activation(activation: str, where: str = "moe_mlp") -> bool:
    """Whether `activation` is gated; a ValueError naming the argument when it is unknown."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation][1]


def apply_activation(h: jax.Array, activation: str) -> jax.Array:
    """[R, 2F] -> [R, F] for the gated activations (gate = first F columns), [R, F] -> [R, F] else."""
    fn, gated = ACTIVATIONS[activation]
    if gated:
        gate, up = jnp.split(h, 2, axis=-1)
        return fn(gate) * up
    return fn(h)


def expert_mlp(rows: jax.Array, group_sizes: jax.Array, w_in: jax.Array, w_out: jax.Array,
               activation: str = "swiglu", matmul: Callable = ragged_dot) -> jax.Array:
    """Each group's MLP on its rows: rows [R, H] grouped by expert (group_sizes [L]), w_in
    [L, H, 2F] (gated) or [L, H, F], w_out [L, F, H'] -> [R, H']. This is the `expert_fn` that
    expert parallelism calls on a device's local experts. Where the fused first GEMM runs
    (gather_gemm.py), the forward applies the activation in its epilogue."""
    if matmul is ragged_dot and _fuses_activation(rows, w_in, activation):
        return _fused_expert_mlp(rows, group_sizes, w_in, w_out, activation)
    gate_up = matmul(rows, w_in, group_sizes)
    # The backward keeps gate_up (and the inputs) and recomputes the activation, instead of
    # keeping the activation's output and its intermediates.
    second = jax.checkpoint(lambda g, w: matmul(apply_activation(g, activation), w, group_sizes))
    return second(gate_up, w_out)


def _fuses_activation(rows, w_in, activation, differentiated=False) -> bool:
    """Whether expert_mlp's first GEMM takes gather_gemm's kernel (reading the rows in order)."""
    return rows.ndim == 2 and gather_gemm.layer_kernel_applies(rows, w_in, rows.shape[0], activation, differentiated)


def _in_order(rows):
    return jnp.arange(rows.shape[0], dtype=jnp.int32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _fused_expert_mlp(rows, group_sizes, w_in, w_out, activation):
    """expert_mlp with the activation in the first GEMM's epilogue. Its JVP keeps what the plain
    one does (the inputs and gate_up, the activation recomputed in the backward). Undifferentiated
    it runs the fused kernel; its JVP computes the primal on the fused kernel only where
    MOE_GATHER_GEMM=1 (the composition otherwise), the tangent on the composition."""
    h, _ = gather_gemm.gather_gemm(rows, _in_order(rows), group_sizes, w_in, activation=activation)
    return ragged_dot(h, w_out, group_sizes)


@functools.partial(_fused_expert_mlp.defjvp, symbolic_zeros=True)
def _fused_expert_mlp_jvp(activation, primals, tangents):
    rows, group_sizes, w_in, w_out = primals
    drows, _, dw_in, dw_out = (t if _live(t) else None for t in tangents)
    if _fuses_activation(rows, w_in, activation, differentiated=True):
        h, gate_up = gather_gemm.gather_gemm(rows, _in_order(rows), group_sizes, w_in, activation=activation,
                                             save_pre=True)
    else:
        gate_up = ragged_dot(rows, w_in, group_sizes)
        h = apply_activation(gate_up, activation)
    out = ragged_dot(h, w_out, group_sizes)
    d_gate_up = None if drows is None else ragged_dot(drows, w_in, group_sizes)
    if dw_in is not None:
        d_in = ragged_dot(rows, dw_in, group_sizes)
        d_gate_up = d_in if d_gate_up is None else d_gate_up + d_in
    if d_gate_up is None and dw_out is None:
        return out, jnp.zeros_like(out)
    return out, _second_gemm_tangent(activation, group_sizes, w_out, gate_up, d_gate_up, dw_out)


def _second_gemm_tangent(activation, sizes, w_out, gate_up, d_gate_up, dw_out, w_rows=None, dw_rows=None):
    """The tangent of ragged_dot(w_rows * act(gate_up), w_out) (w_rows [R, 1], the gates in row
    order, or none) for the tangents of gate_up, w_out and w_rows (each may be None). Checkpointed:
    the backward keeps gate_up and w_rows and recomputes h and w * h. MOE_DOWN_BACKWARD=fused:
    down_backward.py's primitive, whose transpose runs that backward in one pass."""
    if down_backward.enabled():
        return down_backward.down_tangent(activation, sizes, w_out, gate_up, d_gate_up, dw_out, w_rows, dw_rows)

    @jax.checkpoint
    def tangent(gate_up, w_rows, d_gate_up, dw_rows, dw_out):
        act = lambda g: apply_activation(g, activation)
        weigh = (lambda a: a) if w_rows is None else (lambda a: w_rows * a)
        terms, dh_weighted = [], None
        if d_gate_up is not None:
            h, dh = jax.jvp(act, (gate_up,), (d_gate_up,))
            dh_weighted = weigh(dh)
        else:
            h = act(gate_up)
        if dw_rows is not None:
            dh_weighted = dw_rows * h if dh_weighted is None else dh_weighted + dw_rows * h
        if dh_weighted is not None:
            terms.append(ragged_dot(dh_weighted.astype(gate_up.dtype), w_out, sizes))
        if dw_out is not None:
            terms.append(ragged_dot(weigh(h).astype(gate_up.dtype), dw_out, sizes))
        return sum(terms[1:], terms[0])

    return tangent(gate_up, w_rows, d_gate_up, dw_rows, dw_out)


def check_expert_weights(w_in, w_out, hidden_size: int, activation: str, where: str = "moe_mlp") -> None:
    gated = check_activation(activation, where)
    for name, w in (("w_in", w_in), ("w_out", w_out)):
        if not hasattr(w, "shape") or w.ndim != 3:
            raise ValueError(f"{where}: {name} must be a 3-D array [E, ., .], got {getattr(w, 'shape', type(w))}")
    E, H, F2 = w_in.shape
    F = w_out.shape[1]
    want = f"[E, H, 2F] = [{w_out.shape[0]}, {hidden_size}, {2 * F}]" if gated else \
        f"[E, H, F] = [{w_out.shape[0]}, {hidden_size}, {F}]"
    if E != w_out.shape[0] or H != hidden_size or F2 != (2 * F if gated else F):
        raise ValueError(f"{where}: w_in must have shape {want} for activation {activation!r} "
                         f"(from x [T, {hidden_size}] and w_out {tuple(w_out.shape)}), got {tuple(w_in.shape)}")


def moe_mlp(
    x: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    activation: str = "swiglu",
    expert_map: Optional[jax.Array] = None,
    num_local_experts: Optional[int] = None,
    layer=None,
    residual: Optional[jax.Array] = None,
) -> jax.Array:
    """The routed experts' weighted sum: out[t] = sum_k weights[t,k] * MLP_{ids[t,k]}(x[t]).

    Args:
      x: [T, H] float32, bfloat16 or float16; the matmuls run in x's dtype (weights are cast).
      weights: [T, K] float32/bfloat16/float16 gates (e.g. `route(...).weights`).
      ids: [T, K] integer experts; ids outside [0, E) (or mapped to -1) contribute nothing.
      w_in: [L, H, 2F] for "swiglu"/"geglu" (columns [gate | up]), [L, H, F] for "gelu"/"relu".
      w_out: [L, F, H'].
      activation: "swiglu" (silu(gate) * up), "geglu" (gelu(gate) * up), "gelu", "relu".
      expert_map: optional [E] int array mapping a global expert to its row of w_in/w_out in
        [0, L) or -1 (not here), for expert parallelism; num_local_experts = L is then required.
      layer: optional int32 scalar (e.g. a `lax.scan`'s layer counter, traced): w_in and w_out
        are then stacks [NL, L, ., .] over a model's layers and the call uses w_in[layer],
        w_out[layer] (as `lax.dynamic_index_in_dim` indexes: negative from the end, then clamped).
        In a decode step the fused decode
        kernels read that layer on the device, where a slice of the stack made in the scan would
        cost XLA a host round trip per layer (docs/layer.md, "Stacked layers").
      residual: optional [T, H'] in x's dtype, added to the result (a decoder block's
        `x + moe_mlp(x, ...)`, equal to that add): the fused decode kernels add it in their last
        launch, the other paths in the unpermute's (moe_unpermute's `residual`), which saves
        the add's own launch in a decode step.

    Returns [T, H'] in x's dtype (the weighted sum accumulates in float32). On a mesh with
    Explicit axes it has x's sharding, and with x's tokens split each device computes its own
    (data parallel: the weights replicated, their gradients summed over the devices).
    """
    if not hasattr(x, "shape") or x.ndim != 2:
        raise ValueError(f"moe_mlp: x must have shape [T, H], got {getattr(x, 'shape', type(x))}")
    if layer is not None:
        for name, w in (("w_in", w_in), ("w_out", w_out)):
            if not hasattr(w, "shape") or w.ndim != 4:
                raise ValueError(f"moe_mlp: with layer, {name} must be a 4-D stack [NL, E, ., .] over the "
                                 f"layers, got {getattr(w, 'shape', type(w))}")
        layer = ops.check_layer(layer, (("w_in", w_in), ("w_out", w_out)), "moe_mlp")
        check_expert_weights(*(jax.ShapeDtypeStruct(w.shape[1:], w.dtype) for w in (w_in, w_out)), x.shape[1],
                             activation)
    else:
        check_expert_weights(w_in, w_out, x.shape[1], activation)
    L = w_in.shape[-3]
    if expert_map is None:
        num_experts = L
        if num_local_experts is not None and num_local_experts != L:
            raise ValueError(f"moe_mlp: num_local_experts ({num_local_experts}) must equal w_in.shape[0] ({L})")
    else:
        if num_local_experts != L:
            raise ValueError(f"moe_mlp: num_local_experts ({num_local_experts}) must be given with expert_map "
                             f"and equal w_in.shape[0] ({L})")
        num_experts = expert_map.shape[0]
    for name, a in (("weights", weights), ("ids", ids)):
        if not hasattr(a, "shape") or a.ndim != 2 or a.shape[0] != x.shape[0]:
            raise ValueError(f"moe_mlp: {name} must have shape [T, K] with T = {x.shape[0]}, "
                             f"got {getattr(a, 'shape', type(a))}")
    if weights.shape != ids.shape:
        raise ValueError(f"moe_mlp: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must have equal shapes")
    ops.check_float(x, "x", "moe_mlp", ops.WEIGHT_DTYPES)  # the matmuls' dtype: float32, bfloat16, float16
    ops.check_float(weights, "weights", "moe_mlp", ops.WEIGHT_DTYPES)
    ops.check_int(ids, "ids", "moe_mlp")
    if residual is not None:
        want = (x.shape[0], w_out.shape[-1])
        if not hasattr(residual, "shape") or tuple(residual.shape) != want or residual.dtype != x.dtype:
            raise ValueError(f"moe_mlp: residual must have shape {want} and x's dtype {x.dtype}, got "
                             f"{getattr(residual, 'shape', type(residual))} {getattr(residual, 'dtype', '')}")
    # Tokens split over Explicit mesh axes: each device runs the layer on its own (data parallel).
    routed = lambda x, weights, ids, residual, w_in, w_out, expert_map, layer: _routed_experts(
        x, weights, ids, w_in, w_out, expert_map, layer, residual, activation, num_experts, num_local_experts)
    out = over_token_shards(routed, (x, weights, ids, residual),
                            (w_in.astype(x.dtype), w_out.astype(x.dtype), expert_map, layer))
    return sharded_like(out, x)


# What the backward keeps (the saved-residuals policy). A dense SwiGLU MLP under autodiff keeps
# its input, both halves and silu's intermediates; the plain composition below would keep more:
# the permuted rows [T*K, H], the expert outputs [T*K, H] (for the gates' gradient) and
# activation intermediates. The JVP rule keeps x, the routing and the first GEMM's output
# [T*K, 2F] only, and recomputes in the backward what is cheap: the permuted rows (one gather),
# the activation, and h * w. The gates' gradient needs no expert outputs: with h' = w * h,
# out = sum_k (h'_k @ w_out), so d w_k = <(d out) @ w_out^T, h_k>. The forward (what inference
# and, with MOE_GATHER_GEMM=1, the JVP's primal run) gathers the rows inside the first GEMM and
# applies the activation in its epilogue where that kernel runs (gather_gemm.py: sm_90, bf16/f16;
# a differentiated pass runs the composition by default, measured faster), for decode-sized calls
# runs the fused decode MLP (decode_mlp.py), and is the plain composition elsewhere; the tangent
# equals the composition's derivative to rounding, and derivatives of any order go through the
# same kernels.


@functools.partial(jax.custom_jvp, nondiff_argnums=(8, 9, 10))
def _routed_experts(x, weights, ids, w_in, w_out, expert_map, layer, residual, activation, num_experts,
                    num_local_experts):
    if decode_mlp.kernel_applies(x, ids, w_in, w_out):  # a decode step: the fused kernels
        local = ids if expert_map is None else _local_ids(ids, expert_map)
        return decode_mlp.moe_mlp_decode(x, weights, local, w_in, w_out, activation=activation, layer=layer,
                                         residual=residual)
    # Stacked weights stay whole: the CUTLASS grouped GEMMs read the layer on the device. The fused
    # first GEMM takes one layer's weights, which XLA copies out of the stack on every call (768 MiB
    # a Qwen3-30B-A3B layer; a 24-layer step at T = 64 took 3.1x as long), so it runs unstacked only.
    if layer is None and gathers_rows(x, ids, w_in, activation):
        row_token, sizes, row_map = routing_rows(x, ids, num_experts, expert_map, num_local_experts)
        h, _ = gather_gemm.gather_gemm(x, row_token, sizes, w_in, activation=activation)
        return ops.moe_unpermute(ragged_dot(h, w_out, sizes), row_map, weights, out_dtype=x.dtype,
                                 residual=residual)
    return unfused_routed_experts(x, weights, ids, w_in, w_out, activation, expert_map, num_local_experts, layer,
                                  residual)


def gathers_rows(x, ids, w_in, activation, differentiated=False) -> bool:
    """Whether the first GEMM gathers its rows from x itself (gather_gemm.py's fused kernel)."""
    return x.shape[0] < _EXACT_TOKENS and gather_gemm.layer_kernel_applies(x, w_in, x.shape[0] * ids.shape[1],
                                                                           activation, differentiated)


_EXACT_TOKENS = 2**24  # token indices ride through the permute as float32 values


def routing_rows(x, ids, num_experts, expert_map=None, num_local_experts=None):
    """The permute's layout without the permuted rows: (row_token [R] int32, the token of each row,
    -1 on padding; group_sizes [L]; row_map [T, K]). The token indices are the permuted rows of a
    one-column array (t + 1, exact in float32), so the [R, H] copy of x is never made."""
    tokens = jnp.arange(1, x.shape[0] + 1, dtype=jnp.float32)[:, None]
    res = ops.moe_permute(tokens, ids, num_experts, expert_map=expert_map, num_local_experts=num_local_experts)
    return res.hidden[:, 0].astype(jnp.int32) - 1, res.group_sizes, res.row_map


def unfused_routed_experts(x, weights, ids, w_in, w_out, activation, expert_map=None, num_local_experts=None,
                           layer=None, residual=None):
    """permute -> expert_mlp -> weighted unpermute (+ residual, in the unpermute's launch); ids index
    w_in's experts unless expert_map maps them. With `layer`, w_in and w_out are stacks over layers
    whose grouped GEMMs read that layer."""
    num_experts = w_in.shape[-3] if expert_map is None else expert_map.shape[0]
    res = ops.moe_permute(x, ids, num_experts, expert_map=expert_map, num_local_experts=num_local_experts)
    matmul = ragged_dot if layer is None else functools.partial(ragged_dot_stacked, layer=layer)
    y = expert_mlp(res.hidden, res.group_sizes, w_in, w_out, activation, matmul=matmul)
    return ops.moe_unpermute(y, res.row_map, weights, out_dtype=x.dtype, residual=residual)


def _local_ids(ids, expert_map):
    """Global ids -> rows of the local weights, -1 for ids outside [0, E) or not here."""
    E = expert_map.shape[0]
    inside = (ids >= 0) & (ids < E)
    return jnp.where(inside, expert_map[jnp.clip(ids, 0, E - 1)], -1)


def _to_rows(a, row_map, num_rows, dtype, weights=None):
    """a [T, H'] -> [num_rows, H'] with row row_map[t,k] = weights[t,k] * a[t] (zeros elsewhere)."""
    w = primitives.placeholder(3) if weights is None else weights[None]
    out = primitives.scatter(a[None], row_map[None], w, num_rows, dtype, has_weights=weights is not None)
    return out[0]


def _weights_to_rows(weights, row_map, num_rows):
    """The gates in row order, float32 [num_rows, 1] (zero on padding rows)."""
    ones = jnp.ones((row_map.shape[0], 1), jnp.float32)
    return _to_rows(ones, row_map, num_rows, jnp.float32, weights.astype(jnp.float32))


def _live(t):
    return not isinstance(t, SymbolicZero)


@functools.partial(_routed_experts.defjvp, symbolic_zeros=True)
def _routed_experts_jvp(activation, num_experts, num_local_experts, primals, tangents):
    x, weights, ids, w_in, w_out, expert_map, layer, residual = primals
    dx, dweights, _, dw_in, dw_out, _, _, dresidual = (t if _live(t) else None for t in tangents)
    w_in, w_out, dw_in, dw_out = (ops.layer_weights(w, layer) for w in (w_in, w_out, dw_in, dw_out))
    # The first GEMM's weight gradient reads x through the row -> token index where that kernel runs
    # (the layer's T * K rows).
    wgrad_gathers = dw_in is not None and gather_gemm.layer_gathers_wgrad(x, w_in, x.shape[0] * ids.shape[1], activation)
    row_token = None
    if gathers_rows(x, ids, w_in, activation, differentiated=True):  # rows gathered, activation in the first GEMM
        row_token, sizes, row_map = routing_rows(x, ids, num_experts, expert_map, num_local_experts)
        h, gate_up = gather_gemm.gather_gemm(x, row_token, sizes, w_in, activation=activation, save_pre=True)
    else:
        res = ops.moe_permute(x, ids, num_experts, expert_map=expert_map, num_local_experts=num_local_experts)
        sizes, row_map = res.group_sizes, res.row_map
        gate_up = ragged_dot(res.hidden, w_in, sizes)
        h = apply_activation(gate_up, activation)
    num_rows = gate_up.shape[0]
    # The second GEMM's backward reads the output's cotangent through it (MOE_DOWN_BACKWARD).
    down_gathers = down_backward.layer_gathers(x, gate_up, w_out, x.shape[0] * ids.shape[1], activation)
    if row_token is None and (wgrad_gathers or down_gathers):  # the same rows in the permute's order
        row_token = routing_rows(x, ids, num_experts, expert_map, num_local_experts)[0]
    out = ops.moe_unpermute(ragged_dot(h, w_out, sizes), row_map, weights, out_dtype=x.dtype, residual=residual)
    if dx is None and dweights is None and dw_in is None and dw_out is None:
        return out, jnp.zeros_like(out) if dresidual is None else dresidual

    d_gate_up = []
    if dx is not None:
        d_gate_up.append(ragged_dot(_to_rows(dx, row_map, num_rows, x.dtype), w_in, sizes))
    if wgrad_gathers:  # linear in dw_in: its transpose, the weight gradient, reads x's rows itself
        d_gate_up.append(gather_gemm.gather_gemm(x, row_token, sizes, dw_in, activation="none")[0])
    elif dw_in is not None:  # the rows are gathered again from x in the backward, not saved
        d_gate_up.append(jax.checkpoint(
            lambda x, dw: ragged_dot(_to_rows(x, row_map, num_rows, x.dtype), dw, sizes))(x, dw_in))
    d_gate_up = sum(d_gate_up[1:], d_gate_up[0]) if d_gate_up else None
    w_rows = _weights_to_rows(weights, row_map, num_rows)
    dw_rows = None if dweights is None else _weights_to_rows(dweights, row_map, num_rows)

    if down_gathers and (d_gate_up is not None or dw_rows is not None or dw_out is not None):
        d_out = down_backward.down_tangent(activation, sizes, w_out, gate_up, d_gate_up, dw_out, w_rows, dw_rows,
                                           row_token=row_token, row_map=row_map, out_dtype=x.dtype)
        return out, d_out if dresidual is None else d_out + dresidual.astype(x.dtype)
    d_y = _second_gemm_tangent(activation, sizes, w_out, gate_up, d_gate_up, dw_out, w_rows, dw_rows)
    return out, ops.moe_unpermute(d_y, row_map, None, out_dtype=x.dtype, residual=dresidual)


# The pieces the Flax modules share (they import flax; this file does not).


def check_module_args(where, hidden_size, ffn_size, num_experts, top_k, activation, scoring, num_groups,
                      topk_groups, num_shared_experts, mesh, expert_axis, token_rounding=None) -> None:
    """Construction-time checks shared by the NNX and Linen modules."""
    for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_experts", num_experts),
                        ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k ({top_k}) must be <= num_experts ({num_experts})")
    check_activation(activation, where)
    check_routing_args(num_experts, top_k, scoring, num_groups, topk_groups)
    check_token_rounding(token_rounding, top_k, where)
    if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
        raise ValueError(f"{where}: num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
    if (mesh is None) != (expert_axis is None):
        raise ValueError(f"{where}: mesh and expert_axis go together (expert parallelism needs both)")
    if mesh is not None:
        if expert_axis not in mesh.shape:
            raise ValueError(f"{where}: expert_axis {expert_axis!r} is not an axis of mesh {dict(mesh.shape)}")
        if num_experts % mesh.shape[expert_axis]:
            raise ValueError(f"{where}: num_experts ({num_experts}) must be divisible by the size of expert_axis "
                             f"{expert_axis!r} ({mesh.shape[expert_axis]})")


def expert_parallel(x, weights, ids, w_in, w_out, *, activation, num_experts, mesh, expert_axis):
    """The routed experts with tokens and experts both split over `expert_axis`: each device
    runs `jax_moe_permute.parallel.moe_ep` on its token shard with its w_in/w_out shard.
    x [T, H], weights/ids [T, K] (global), w_in [E, H, .], w_out [E, F, H] -> [T, H]."""
    from jax.sharding import PartitionSpec as P

    from . import parallel

    T = x.shape[0]
    n = mesh.shape[expert_axis]
    pad = -T % n
    if pad:  # token count not divisible by the axis: zero rows with zero gates contribute nothing
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)))

    def local(x, weights, ids, w_in, w_out):
        expert_fn = lambda rows, group_sizes: expert_mlp(rows, group_sizes, w_in, w_out, activation)
        return parallel.moe_ep(x, ids, weights, expert_fn, num_experts=num_experts, axis_name=expert_axis)

    tokens, experts = P(expert_axis, None), P(expert_axis, None, None)
    specs = (tokens, tokens, tokens, experts, experts)
    args = (x, weights, ids, w_in, w_out)
    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[expert_axis] == jax.sharding.AxisType.Explicit
    on_mesh = jax.sharding.NamedSharding(mesh, P())
    if explicit:  # shard_map takes operands on Explicit axes only as its in_specs split them
        args = tuple(resharded(a, spec, on_mesh) for a, spec in zip(args, specs))
    out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tokens)(*args)
    if explicit and pad:  # the padding rows go from a replicated result: an uneven split has no slice
        out = resharded(out, (None, None), on_mesh)
    return out[:T]


def shared_mlp(x, w_in, w_out, activation):
    """The always-on shared experts: a dense MLP, x [T, H] @ w_in [H, 2SF] -> act -> @ w_out."""
    return apply_activation(x @ w_in, activation) @ w_out


def reference_moe_mlp(x, weights, ids, w_in, w_out, *, activation: str = "swiglu") -> jax.Array:
    """The same layer the way JAX MoE code is written today (argsort + take, jax.lax.ragged_dot,
    gather + weighted sum: `jax_moe_permute.reference`); the benchmark's baseline."""
    from . import reference

    E = w_in.shape[0]
    rows, group_sizes, row_map = reference.moe_permute(x, ids, E)
    y = expert_mlp(rows, group_sizes, w_in.astype(x.dtype), w_out.astype(x.dtype), activation,
                   matmul=jax.lax.ragged_dot)
    return reference.moe_unpermute(y, row_map, weights, out_dtype=x.dtype)
