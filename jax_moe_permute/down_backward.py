"""The expert MLP's second half, y = ragged_dot(w * act(gate_up), w_out) (w the gates in row order,
or none), as the layer's derivative sees it: one primitive for its tangent (down_tangent_p), linear
in the tangents of gate_up, w and w_out, whose transpose rule is the backward of the whole half in
one pass (down_vjp_p, then w_out's weight-gradient GEMM).

Given the rows' cotangent ct [R, H], the backward is the d lhs GEMM g = ct · w_outᵀ [R, F] and
three element-wise results of g: d gate_up = act'(gate_up)ᵀ (w * g), the gates' gradient
d w = Σ_f g * h (h = act(gate_up)), and w * h, the lhs of w_out's gradient (w * h)ᵀ · ct (the
weight-gradient GEMM). All three are what an epilogue of the d lhs GEMM can compute while g is
still in registers, so that the [R, F] product is never written nor read back
(docs/design-notes.md, "Grouped GEMM tiles", item 9): down_vjp_p lowers to that kernel
(cpp/gemm/down_backward.cu) on sm_90 for bf16 / f16 where it fits, elsewhere to a composition of
our grouped GEMMs and XLA's element-wise ops, in float32 from g onwards.

Gathered form (row_token and row_map given): the tangent is taken through the layer's unweighted
sum of each token's rows, unpermute(y', row_map) [T, H], so that the backward starts from the
output's cotangent ct [T, H] itself: the d lhs GEMM reads ct's rows through row_token (the
kernel's cp.async gather) and w_out's weight gradient reads them as its gathered rhs
(gather_gemm.gathered_wgrad), and the [R, H] copy of ct (unpermute's backward) is never written.

MOE_DOWN_BACKWARD (read when the layer is traced): "preferred" (the default) takes the gathered
form in the layer where its kernel runs for fine-grained experts (gather_gemm.backward_gathers, the
rule of the first GEMM's gathered weight gradient; on an H100, Qwen3-30B-A3B's backward 6.8%
faster at T = 16384 and 1.2% at T = 4096, Mixtral's 3% slower at T = 4096) and the composition
elsewhere; "composition" differentiates the layer's plain tangent
(checkpointed: h and w * h recomputed); "fused" takes this primitive; "gathered" its gathered form
wherever the layer runs.
Derivatives of the tangent itself (second order), and vmapped ones, run the plain composition.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _native, gemm_primitives
from .batch_axis import bind_operands
from .gather_gemm import ACTIVATION_CODES, backward_gathers
from .grouped_gemm import ragged_dot
from .primitives import placeholder

MODES = ("preferred", "composition", "fused", "gathered")


def enabled() -> bool:
    """Whether a second GEMM's backward outside the layer's routing (expert_mlp) takes this
    primitive: MOE_DOWN_BACKWARD=fused or gathered."""
    return gemm_primitives.env_choice("MOE_DOWN_BACKWARD", MODES) in ("fused", "gathered")


def layer_gathers(x, gate_up, w_out, rows: int, activation: str) -> bool:
    """Whether the layer's backward takes the gathered form (MOE_DOWN_BACKWARD) for x [T, H], the
    first GEMM's output gate_up [R, N] of which `rows` are routed, and w_out [G, F, H]."""
    mode = gemm_primitives.env_choice("MOE_DOWN_BACKWARD", MODES)
    if mode != "preferred":
        return mode == "gathered"
    G, F, _ = w_out.shape
    return backward_gathers(rows, G, F) and rows > 0 and kernel_fits(x, gate_up, w_out, activation, gathered=True)


def _activation(gate_up, activation):
    from .layer import apply_activation  # layer binds these primitives: import it when first used

    return apply_activation(gate_up, activation)


down_tangent_p = Primitive("jax_moe_permute_down_tangent")
_PARAMS = ("activation", "live", "weighted", "out_dtype")


def down_tangent(activation, sizes, w_out, gate_up, d_gate_up, d_w_out, w=None, d_w=None, row_token=None,
                 row_map=None, out_dtype=None):
    """The tangent of ragged_dot(w * act(gate_up), w_out, sizes) (w [R, 1] float32, or None: no
    gates) for the tangents d_gate_up [R, 2F or F], d_w_out [L, F, H] and d_w [R, 1], each of which
    may be None (zero); at least one is not. With row_token [R] and row_map [T, K] (the gathered
    form), that of unpermute(·, row_map) of it, [T, H] in out_dtype."""
    live = (d_gate_up is not None, d_w is not None, d_w_out is not None)
    weighted = w is not None
    gathered = row_token is not None
    args = (placeholder(2, gate_up.dtype) if d_gate_up is None else d_gate_up,
            placeholder(2) if d_w is None else d_w,
            placeholder(3, w_out.dtype) if d_w_out is None else d_w_out,
            gate_up, placeholder(2) if w is None else w, w_out, sizes.astype(jnp.int32),
            row_token.astype(jnp.int32) if gathered else jnp.zeros((0,), jnp.int32),
            row_map.astype(jnp.int32) if gathered else jnp.zeros((0, 1), jnp.int32))
    return down_tangent_p.bind(*bind_operands(*args, batched=False), activation=activation, live=live,
                               weighted=weighted, out_dtype=jnp.dtype(out_dtype) if gathered else None)


def _tangent_composition(d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, row_token, row_map, *, activation, live,
                         weighted, out_dtype):
    """down_tangent in plain terms: the derivative of the layer's own composition."""
    d_y = _rows_tangent(d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, activation=activation, live=live,
                        weighted=weighted)
    if out_dtype is None:
        return d_y
    from .ops import moe_unpermute  # ops imports the layer's pieces: import it when first used

    return moe_unpermute(d_y, row_map, None, out_dtype=out_dtype)


def _rows_tangent(d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, *, activation, live, weighted):
    act = functools.partial(_activation, activation=activation)
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


down_vjp_p = Primitive("jax_moe_permute_down_vjp")
down_vjp_p.multiple_results = True


def down_vjp(ct, gate_up, w, w_out, sizes, row_token=None, *, activation, weighted):
    """down_vjp_p: (d gate_up, d w [R, 1] float32, w * h) from ct [R, H], or from ct [T, H] read
    through row_token [R]; w [R, 1] float32 when weighted (any array otherwise)."""
    gathered = row_token is not None
    row_token = row_token.astype(jnp.int32) if gathered else jnp.zeros((0,), jnp.int32)
    return down_vjp_p.bind(*bind_operands(ct, gate_up, w, w_out, sizes.astype(jnp.int32), row_token, batched=False),
                           activation=activation, weighted=weighted, gathered=gathered)


def _vjp_composition(ct, gate_up, w, w_out, sizes, row_token, *, activation, weighted, gathered):
    """The backward of the layer's second half from the rows' cotangent ct [R, H] (gathered: ct
    [T, H] read through row_token [R]): (d gate_up, d w [R, 1] float32, w * h). What the d lhs
    GEMM's epilogue is to compute, in plain terms."""
    if gathered:
        from .gather_gemm import gathered_rows  # gather_gemm imports this module's users: when used

        ct = gathered_rows(ct, row_token)
    g = gemm_primitives.ragged_dot_bind(ct[None], w_out[None], sizes[None], rhs_transposed=True, out_dtype=ct.dtype,
                                        precision=None)[0].astype(jnp.float32)
    h, act_vjp = jax.vjp(functools.partial(_activation, activation=activation), gate_up.astype(jnp.float32))
    d_gate_up = act_vjp(w * g if weighted else g)[0].astype(gate_up.dtype)
    # Rows past the groups' sum: g is zero there, and w * h is written as zeros too (as the kernel does).
    covered = jnp.arange(gate_up.shape[0])[:, None] < jnp.sum(jnp.maximum(sizes, 0))
    w_h = jnp.where(covered, w * h if weighted else h, 0.0).astype(gate_up.dtype)
    return d_gate_up, jnp.sum(g * h, axis=-1, keepdims=True), w_h


def _vjp_abstract(ct, gate_up, w, w_out, sizes, row_token, *, activation, weighted, gathered):
    avals = (ct, gate_up, w, w_out, sizes, row_token)
    R = gate_up.shape[0]
    return [_compat.shaped_like(avals, gate_up.shape, gate_up.dtype),
            _compat.shaped_like(avals, (R, 1), jnp.float32),
            _compat.shaped_like(avals, (R, w_out.shape[1]), gate_up.dtype)]


def kernel_fits(ct, gate_up, w_out, activation: str, gathered: bool = False) -> bool:
    """Whether down_vjp_p takes the kernel for these static shapes and dtypes (its launcher's rule;
    gathered: ct is [T, H], read through the row index)."""
    if not (_native.has_target("cuda", "down_backward") and gemm_primitives.kernels_available()):
        return False
    if ct.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or {gate_up.dtype, w_out.dtype} != {ct.dtype}:
        return False
    (T, H), R, (E, F, _) = ct.shape, gate_up.shape[0], w_out.shape
    if gathered and T >= 2**31:
        return False
    return _native.kernel_fits("cuda", "down_backward", R, H, E, F, ACTIVATION_CODES[activation])


def kernel_outputs(ct, gate_up, w, w_out, sizes, row_token=None, *, activation, weighted):
    """The kernel's own outputs: d gate_up, the gates' gradient as partial sums per 256 columns
    [ceil(F / 256), R], and w * h; with row_token [R], ct [T, H] is read through it."""
    R, F = gate_up.shape[0], w_out.shape[1]
    out_types = (jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
                 jax.ShapeDtypeStruct(((F + 255) // 256, R), jnp.float32),
                 jax.ShapeDtypeStruct((R, F), gate_up.dtype))
    gathered = row_token is not None
    row_token = row_token if gathered else jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call(_native.target("down_backward"), out_types)(
        ct, row_token, gate_up, w, w_out, sizes, activation=np.int64(ACTIVATION_CODES[activation]),
        weighted=np.int64(weighted), gathered=np.int64(gathered))


def _vjp_kernel(ct, gate_up, w, w_out, sizes, row_token, *, activation, weighted, gathered):
    """down_vjp_p on the kernel: the gates' partial sums added up."""
    d_gate_up, d_w_parts, w_h = kernel_outputs(ct, gate_up, w, w_out, sizes, row_token if gathered else None,
                                               activation=activation, weighted=weighted)
    return d_gate_up, jnp.sum(d_w_parts, axis=0)[:, None], w_h


def _lower_vjp_cuda(ctx, ct, gate_up, w, w_out, sizes, row_token, *, activation, weighted, gathered):
    ct_aval, gate_up_aval, _, w_out_aval, _, _ = ctx.avals_in
    rule = _lower_vjp_composition
    if (_compat.lowers_per_device(ctx) and gate_up_aval.shape[0] > 0
            and kernel_fits(ct_aval, gate_up_aval, w_out_aval, activation, gathered)):
        rule = _lower_vjp_kernel
    return rule(ctx, ct, gate_up, w, w_out, sizes, row_token, activation=activation, weighted=weighted,
                gathered=gathered)


def _abstract(d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, row_token, row_map, *, out_dtype, **params):
    avals = (d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, row_token, row_map)
    if out_dtype is not None:  # gathered: the tokens' sum
        return _compat.shaped_like(avals, (row_map.shape[0], w_out.shape[2]), out_dtype)
    return _compat.shaped_like(avals, (gate_up.shape[0], w_out.shape[2]), gate_up.dtype)


def _transpose(ct, d_gate_up, d_w, d_w_out, gate_up, w, w_out, sizes, row_token, row_map, *, activation, live,
               weighted, out_dtype):
    """Linear in the three tangents only: gate_up, w, w_out, sizes and the routing are known here."""
    need = tuple(ad.is_undefined_primal(a) for a in (d_gate_up, d_w, d_w_out))
    if type(ct) is ad.Zero or not any(need):
        return [None] * 9
    gathered = out_dtype is not None
    ct = ct.astype(gate_up.dtype)
    if need[0] or need[1]:  # the d lhs GEMM and its epilogue
        d_gate_up_ct, d_w_ct, w_h = down_vjp(ct, gate_up, w, w_out, sizes, row_token if gathered else None,
                                             activation=activation, weighted=weighted)
    else:  # w_out's gradient alone: no GEMM before it
        d_gate_up_ct = d_w_ct = None
        h = _activation(gate_up.astype(jnp.float32), activation)
        w_h = (w * h if weighted else h).astype(gate_up.dtype)
    d_gate_up_ct, d_w_ct = (d_gate_up_ct if need[0] else None), (d_w_ct if need[1] else None)
    d_w_out_ct = None
    if need[2] and gathered:  # (w * h)ᵀ · ct[row_token] per group: ct's rows read through the index
        from .gather_gemm import gathered_wgrad  # gather_gemm imports this module's users: when used

        d_w_out_ct = gathered_wgrad(w_h, row_token, ct, sizes, gather_rhs=True).astype(d_w_out.aval.dtype)
    elif need[2]:  # ragged_dot's weight gradient: (w * h)ᵀ · ct per group
        d_w_out_ct = gemm_primitives.ragged_dot_wgrad_bind(w_h[None], ct[None], sizes[None],
                                                           out_dtype=d_w_out.aval.dtype, precision=None)[0]
    return [d_gate_up_ct, d_w_ct, d_w_out_ct] + [None] * 6


def _composition_rules(composition, multiple_results):
    """JVP and batching rules that run the primitive's composition: derivatives of the backward
    and vmapped calls take the plain ops."""

    def jvp(primals, tangents, **params):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        out, d_out = jax.jvp(functools.partial(composition, **params), tuple(primals), tangents)
        return (list(out), list(d_out)) if multiple_results else (out, d_out)

    def batch(args, dims, **params):
        out = jax.vmap(functools.partial(composition, **params), in_axes=dims)(*args)
        return out, ([0] * len(out) if multiple_results else 0)

    return jvp, batch


for p, composition, abstract, params in ((down_tangent_p, _tangent_composition, _abstract, _PARAMS),
                                          (down_vjp_p, _vjp_composition, _vjp_abstract, ("activation", "weighted", "gathered"))):
    p.def_impl(jax.jit(p.bind, static_argnames=params))
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(composition, multiple_results=p.multiple_results))
    ad.primitive_jvps[p], batching.primitive_batchers[p] = _composition_rules(composition, p.multiple_results)
    _compat.require_devices_at_lowering(p)  # its composition holds our grouped GEMMs
ad.primitive_transposes[down_tangent_p] = _transpose
_lower_vjp_composition = mlir.lower_fun(_vjp_composition, multiple_results=True)
_lower_vjp_kernel = mlir.lower_fun(_vjp_kernel, multiple_results=True)
if _native.has_target("cuda", "down_backward"):
    mlir.register_lowering(down_vjp_p, _lower_vjp_cuda, platform="cuda")
