"""The expert MLP's second half, y = ragged_dot(w * act(gate_up), w_out) (w the gates in row order,
or none), as the layer's derivative sees it: one primitive for its tangent, linear in the tangents
of gate_up, w and w_out, whose transpose rule is the backward of the whole half in one pass.

Given the rows' cotangent ct [R, H], the backward is the d lhs GEMM g = ct · w_outᵀ [R, F] and
three element-wise results of g: d gate_up = act'(gate_up)ᵀ (w * g), the gates' gradient
d w = Σ_f g * h (h = act(gate_up)), and w * h, the lhs of w_out's gradient (w * h)ᵀ · ct (the
weight-gradient GEMM). All three are what an epilogue of the d lhs GEMM can compute while g is
still in registers, so that the [R, F] product is never written nor read back
(docs/design-notes.md, "Grouped GEMM tiles", item 9). Here they run as a composition of our
grouped GEMMs and XLA's element-wise ops, in float32 from g onwards.

MOE_DOWN_BACKWARD (read when the layer is traced): "composition" (the default) differentiates the
layer's plain tangent (checkpointed: h and w * h recomputed); "fused" takes this primitive.
Derivatives of the tangent itself (second order), and vmapped ones, run the plain composition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, gemm_primitives
from .grouped_gemm import ragged_dot
from .primitives import placeholder

MODES = ("composition", "fused")


def enabled() -> bool:
    """Whether the layer's backward takes this primitive (MOE_DOWN_BACKWARD)."""
    return gemm_primitives.env_choice("MOE_DOWN_BACKWARD", MODES) == "fused"


down_tangent_p = Primitive("jax_moe_permute_down_tangent")
_PARAMS = ("activation", "live", "weighted")


def down_tangent(activation, sizes, w_out, gate_up, d_gate_up, d_w_out, w=None, d_w=None):
    """The tangent of ragged_dot(w * act(gate_up), w_out, sizes) (w [R, 1] float32, or None: no
    gates) for the tangents d_gate_up [R, 2F or F], d_w_out [L, F, H] and d_w [R, 1], each of which
    may be None (zero); at least one is not."""
    live = (d_gate_up is not None, d_w is not None, d_w_out is not None)
    weighted = w is not None
    args = (placeholder(2, gate_up.dtype) if d_gate_up is None else d_gate_up,
            placeholder(2) if d_w is None else d_w,
            placeholder(3, w_out.dtype) if d_w_out is None else d_w_out,
            gate_up, placeholder(2) if w is None else w, w_out, sizes.astype(jnp.int32))
    return down_tangent_p.bind(*_compat.pvary_to_match(*args), activation=activation, live=live, weighted=weighted)


def _tangent_composition(d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, *, activation, live, weighted):
    """down_tangent in plain terms: the derivative of the layer's own composition."""
    from .layer import apply_activation  # layer binds this primitive: import it when first used

    act = lambda g: apply_activation(g, activation)
    weigh = (lambda a: w * a) if weighted else (lambda a: a)
    has_d_gate_up, has_d_w, has_d_w_out = live
    dh_weighted = None
    if has_d_gate_up:
        h, dh = jax.jvp(act, (gate_up,), (d_gate_up,))
        dh_weighted = weigh(dh)
    else:
        h = act(gate_up)
    if has_d_w:
        dh_weighted = d_w * h if dh_weighted is None else dh_weighted + d_w * h
    terms = []
    if dh_weighted is not None:
        terms.append(ragged_dot(dh_weighted.astype(gate_up.dtype), w_out, sizes))
    if has_d_w_out:
        terms.append(ragged_dot(weigh(h).astype(gate_up.dtype), d_w_out, sizes))
    return sum(terms[1:], terms[0])


def down_vjp(ct, gate_up, w, w_out, sizes, *, activation, weighted, need):
    """The backward of the layer's second half from the rows' cotangent ct [R, H]: (d gate_up,
    d w [R, 1] float32, w * h), each only where `need` (a bool per result) asks for it."""
    from .layer import apply_activation

    dtype = gate_up.dtype
    g = gemm_primitives.ragged_dot_bind(ct[None], w_out[None], sizes[None], rhs_transposed=True, out_dtype=dtype,
                                        precision=None)[0].astype(jnp.float32)
    h, act_vjp = jax.vjp(lambda a: apply_activation(a, activation), gate_up.astype(jnp.float32))
    d_gate_up = act_vjp(w * g if weighted else g)[0].astype(dtype) if need[0] else None
    d_w = jnp.sum(g * h, axis=-1, keepdims=True) if need[1] else None
    w_h = (w * h if weighted else h).astype(dtype) if need[2] else None
    return d_gate_up, d_w, w_h


def _abstract(d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, **params):
    avals = (d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes)
    return _compat.shaped_like(avals, (gate_up.shape[0], w_out.shape[2]), gate_up.dtype)


def _transpose(ct, d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, *, activation, live, weighted):
    """Linear in the three tangents only: gate_up, w, w_out and sizes are known here."""
    need = tuple(ad.is_undefined_primal(a) for a in (d_gate_up, d_w, d_w_out))
    if type(ct) is ad.Zero or not any(need):
        return [None] * 7
    d_gate_up_ct, d_w_ct, w_h = down_vjp(ct, gate_up, w, w_out, sizes, activation=activation, weighted=weighted,
                                         need=need)
    d_w_out_ct = None
    if need[2]:  # ragged_dot's weight gradient: (w * h)ᵀ · ct per group
        d_w_out_ct = gemm_primitives.ragged_dot_wgrad_bind(w_h[None], ct[None], sizes[None],
                                                           out_dtype=d_w_out.aval.dtype, precision=None)[0]
    return [d_gate_up_ct, d_w_ct, d_w_out_ct, None, None, None, None]


def _jvp(primals, tangents, **params):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(functools.partial(_tangent_composition, **params), primals, tangents)


def _batch(args, dims, **params):
    return jax.vmap(functools.partial(_tangent_composition, **params), in_axes=dims)(*args), 0


down_tangent_p.def_impl(jax.jit(down_tangent_p.bind, static_argnames=_PARAMS))
down_tangent_p.def_abstract_eval(_abstract)
mlir.register_lowering(down_tangent_p, mlir.lower_fun(_tangent_composition, multiple_results=False))
batching.primitive_batchers[down_tangent_p] = _batch
ad.primitive_jvps[down_tangent_p] = _jvp
ad.primitive_transposes[down_tangent_p] = _transpose
_compat.require_devices_at_lowering(down_tangent_p)  # its composition holds our grouped GEMMs
