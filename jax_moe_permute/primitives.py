"""The seven primitives behind the public ops, with their batching and autodiff rules; at the
foot, one block per primitive registers its abstract evaluation (shapes.py), lowerings
(lowering.py), batching and autodiff rules.

  moe_permute           (hidden, topk_ids, expert_map) -> (rows, group_sizes, row_map)
  moe_unpermute         (x, row_map, weights) -> out[t] = sum_k w[t,k] x[row_map[t,k]]
  moe_unpermute_add     (x, row_map, weights, residual) -> residual + unpermute, in one launch
  moe_scatter           (x, row_map, weights) -> out[r] = sum_{row_map[t,k]=r} w[t,k] x[t]
  moe_weight_grad       (c, x, row_map)       -> dw[t,k] = <c[t], x[row_map[t,k]]>
  moe_unpermute_tangent (dx, dw, x, row_map, w) -> unpermute(dx, w) + unpermute(x, dw)
  moe_unpermute_bwd     (c, x, row_map, w)      -> (scatter(c, w), weight_grad(c, x)) in one pass

unpermute and scatter are each other's transpose, weight_grad is their transpose with
respect to the weights, and permute's data movement is an unweighted scatter: the set is
closed under transposition, so derivatives of any order stay on our kernels (unpermute_add's
tangent is unpermute's plus the residual's).
unpermute_tangent is unpermute's JVP when both expert rows and weights vary: one linear
primitive, so that its transpose yields both cotangents at once (unpermute_bwd: on CUDA one
kernel reads each cotangent row once for both; elsewhere scatter + weight_grad).

Every operand carries the leading batch axis of batch_axis.py. An absent expert_map or weights operand is a [1, 1] / [1, 1, 1] placeholder flagged by the
static parameter has_map / has_weights.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _native, lowering, shapes
from .batch_axis import batch_extent, batcher, bind_operands, sum_to_batch
from ._compat import require_devices_at_lowering

# Dtypes the kernels write; the ops cast float8 outputs from float32 afterwards.
KERNEL_OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def placeholder(ndim: int, dtype=jnp.float32) -> jax.Array:
    """The operand passed where expert_map / weights are absent."""
    return jnp.zeros((1,) * ndim, dtype)


def _primitive(name: str, abstract_eval, multiple_results: bool = False) -> Primitive:
    p = Primitive(name)
    p.multiple_results = multiple_results
    # Eager calls run the op compiled on its own; one jitted bind per primitive, with the
    # static parameters (the abstract eval's keyword-only arguments) as cache keys.
    static = [n for n, a in inspect.signature(abstract_eval).parameters.items() if a.kind == a.KEYWORD_ONLY]
    p.def_impl(jax.jit(p.bind, static_argnames=static))
    return p


permute_p = _primitive("moe_permute", shapes.permute, multiple_results=True)
unpermute_p = _primitive("moe_unpermute", shapes.unpermute)
unpermute_add_p = _primitive("moe_unpermute_add", shapes.unpermute_add)
scatter_p = _primitive("moe_scatter", shapes.scatter)
weight_grad_p = _primitive("moe_weight_grad", shapes.weight_grad)
unpermute_tangent_p = _primitive("moe_unpermute_tangent", shapes.unpermute_tangent)
unpermute_bwd_p = _primitive("moe_unpermute_bwd", shapes.unpermute_bwd, multiple_results=True)


# ---- binding (operands made to vary alike; float8 outputs produced in float32, then cast) --

def _kernel_dtype(dtype):
    return jnp.dtype(dtype) if jnp.dtype(dtype) in map(jnp.dtype, KERNEL_OUT_DTYPES) else jnp.dtype(jnp.float32)


def permute(hidden, ids, expert_map, *, num_experts, num_local_experts, align_size, has_map):
    return permute_p.bind(*bind_operands(hidden, ids, expert_map), num_experts=num_experts,
                          num_local_experts=num_local_experts, align_size=align_size, has_map=has_map)


def unpermute(x, row_map, weights, out_dtype, *, has_weights):
    out = unpermute_p.bind(*bind_operands(x, row_map, weights), out_dtype=_kernel_dtype(out_dtype),
                           has_weights=has_weights)
    return out.astype(out_dtype)


def unpermute_add(x, row_map, weights, residual, *, has_weights):
    """residual + unpermute(x, row_map, weights) in residual's dtype (a kernel output dtype), the
    unpermute rounded to it before the add: bit for bit the add after the op."""
    return unpermute_add_p.bind(*bind_operands(x, row_map, weights, residual), has_weights=has_weights)


def scatter(x, row_map, weights, num_rows, out_dtype, *, has_weights):
    out = scatter_p.bind(*bind_operands(x, row_map, weights), num_rows=num_rows,
                         out_dtype=_kernel_dtype(out_dtype), has_weights=has_weights)
    return out.astype(out_dtype)


def weight_grad(c, x, row_map, out_dtype):
    return weight_grad_p.bind(*bind_operands(c, x, row_map), out_dtype=_kernel_dtype(out_dtype)).astype(out_dtype)


def unpermute_bwd(c, x, row_map, weights, x_out_dtype, w_out_dtype):
    ct_x, ct_w = unpermute_bwd_p.bind(*bind_operands(c, x, row_map, weights),
                                      x_out_dtype=_kernel_dtype(x_out_dtype), w_out_dtype=_kernel_dtype(w_out_dtype))
    return ct_x.astype(x_out_dtype), ct_w.astype(w_out_dtype)


# ---- lowering helpers -------------------------------------------------------------------

def _register_lowerings(p, reference, op=None, abstract_eval=None, attrs=(), workspace=None):
    """The jnp reference everywhere; our kernel `op` on each platform that has it."""
    mlir.register_lowering(p, mlir.lower_fun(reference, multiple_results=p.multiple_results))
    for platform in _native.platforms():
        if op is not None and _native.has_target(platform, op):
            mlir.register_lowering(p, lowering.kernel_rule(op, platform, abstract_eval, attrs, workspace),
                                   platform=platform)


# Workspace sizes, as `_native.workspace_bytes` takes them: (batch, entries, extent).
def _permute_workspace(in_avals, out_avals):  # extent: local experts
    B, T, K = out_avals[2].shape
    return B, T * K, out_avals[1].shape[1]


def _scatter_workspace(in_avals, out_avals):  # extent: rows
    B, R, _ = out_avals[0].shape
    _, T, K = in_avals[1].shape
    return B, T * K, R


def _unpermute_bwd_workspace(in_avals, out_avals):  # extent: rows
    B, R, _ = out_avals[0].shape
    _, T, K = out_avals[1].shape
    return B, T * K, R


def _composite_unpermute_add(x, row_map, weights, residual, *, has_weights):
    out = unpermute_p.bind(x, row_map, weights, out_dtype=residual.dtype, has_weights=has_weights)
    return out + residual  # extents 1 and B broadcast


def _composite_unpermute_tangent(dx, dw, x, row_map, weights, *, out_dtype):
    bind = lambda a, w: unpermute_p.bind(a, row_map, w, out_dtype=out_dtype, has_weights=True)
    return bind(dx, weights) + bind(x, dw)  # extents 1 and B broadcast


def _composite_unpermute_bwd(c, x, row_map, weights, *, x_out_dtype, w_out_dtype):
    B = batch_extent(c, x, row_map, weights)  # each half may see only extent-1 operands
    outs = [scatter_p.bind(c, row_map, weights, num_rows=x.shape[1], out_dtype=x_out_dtype, has_weights=True),
            weight_grad_p.bind(c, x, row_map, out_dtype=w_out_dtype)]
    return [jnp.broadcast_to(o, (B,) + o.shape[1:]) for o in outs]


def _fused_unpermute_bwd_rule():
    """CUDA: one pass for both cotangents where the fused kernel takes the dtypes (not float8)."""
    fused = lowering.kernel_rule("unpermute_bwd", "cuda", shapes.unpermute_bwd, (), _unpermute_bwd_workspace)
    composite = mlir.lower_fun(_composite_unpermute_bwd, multiple_results=True)
    wide = {jnp.dtype(d) for d in KERNEL_OUT_DTYPES}

    def rule(ctx, *args, **params):
        if {a.dtype for a in ctx.avals_in[:2]} <= wide and ctx.avals_out[0].dtype == ctx.avals_in[1].dtype:
            return fused(ctx, *args, **params)
        return composite(ctx, *args, **params)

    return rule


# ---- autodiff ------------------------------------------------------------------------------

def _zero(aval_like, dtype=None):
    return ad.Zero(core.ShapedArray(aval_like.shape, dtype or aval_like.dtype))


def _sum(terms, out):
    return sum(terms[1:], terms[0]) if terms else _zero(out)


def _permute_jvp(primals, tangents, *, num_experts, num_local_experts, align_size, has_map):
    hidden, ids, expert_map = primals
    rows, group_sizes, row_map = permute_p.bind(hidden, ids, expert_map, num_experts=num_experts,
                                                num_local_experts=num_local_experts, align_size=align_size,
                                                has_map=has_map)
    d_hidden = tangents[0]
    if type(d_hidden) is ad.Zero:
        d_rows = _zero(rows)
    else:  # the data movement is linear: an unweighted scatter of the tangent rows
        d_rows = scatter(d_hidden, row_map, placeholder(3), rows.shape[1], rows.dtype, has_weights=False)
    return (rows, group_sizes, row_map), (d_rows, _zero(group_sizes, jax.dtypes.float0),
                                          _zero(row_map, jax.dtypes.float0))


def _bilinear_jvp(p, linear):
    """JVP of a primitive that is linear in each operand position of `linear` separately."""

    def jvp(primals, tangents, **params):
        out = p.bind(*primals, **params)
        terms = []
        for i in linear:
            if type(tangents[i]) is not ad.Zero:
                args = list(primals)
                args[i] = tangents[i]
                terms.append(p.bind(*args, **params))
        return out, _sum(terms, out)

    return jvp


def _unpermute_tangents(primals, tangents, *, out_dtype, has_weights) -> list:
    """The live terms of unpermute's tangent. With both expert rows and weights varying, one
    unpermute_tangent (whose transpose is the fused backward) instead of two unpermutes
    transposed apart."""
    x, row_map, weights = primals
    dx, _, dw = tangents
    if type(dx) is not ad.Zero and type(dw) is not ad.Zero:
        return [unpermute_tangent_p.bind(dx, dw, x, row_map, weights, out_dtype=out_dtype)]
    bind = lambda a, w: unpermute_p.bind(a, row_map, w, out_dtype=out_dtype, has_weights=has_weights)
    return [bind(a, w) for a, w in ((dx, weights), (x, dw)) if type(a) is not ad.Zero and type(w) is not ad.Zero]


def _unpermute_jvp(primals, tangents, *, out_dtype, has_weights):
    out = unpermute_p.bind(*primals, out_dtype=out_dtype, has_weights=has_weights)
    return out, _sum(_unpermute_tangents(primals, tangents, out_dtype=out_dtype, has_weights=has_weights), out)


def _unpermute_add_jvp(primals, tangents, *, has_weights):
    """unpermute's tangent plus the residual's."""
    out = unpermute_add_p.bind(*primals, has_weights=has_weights)
    terms = _unpermute_tangents(primals[:3], tangents[:3], out_dtype=out.dtype, has_weights=has_weights)
    terms += [tangents[3]] if type(tangents[3]) is not ad.Zero else []
    return out, jnp.broadcast_to(_sum(terms, out), out.shape) if terms else _zero(out)


def _unpermute_transpose(ct, x, row_map, weights, *, out_dtype, has_weights):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_x = ct_w = None
    if ad.is_undefined_primal(x):
        rows = x.aval.shape[1]
        ct_x = sum_to_batch(scatter(ct, row_map, weights, rows, x.aval.dtype, has_weights=has_weights), x)
    if ad.is_undefined_primal(weights):
        ct_w = sum_to_batch(weight_grad(ct, x, row_map, weights.aval.dtype), weights)
    return ct_x, None, ct_w


def _unpermute_add_transpose(ct, x, row_map, weights, residual, *, has_weights):
    """Linear in (x, residual) with the weights fixed, or in the weights with x fixed."""
    if type(ct) is ad.Zero:
        return None, None, None, None
    ct_x, _, ct_w = _unpermute_transpose(ct, x, row_map, weights, out_dtype=ct.dtype, has_weights=has_weights)
    ct_residual = sum_to_batch(ct, residual) if ad.is_undefined_primal(residual) else None
    return ct_x, None, ct_w, ct_residual


def _scatter_transpose(ct, x, row_map, weights, *, num_rows, out_dtype, has_weights):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_x = ct_w = None
    if ad.is_undefined_primal(x):
        ct_x = sum_to_batch(unpermute(ct, row_map, weights, x.aval.dtype, has_weights=has_weights), x)
    if ad.is_undefined_primal(weights):
        ct_w = sum_to_batch(weight_grad(x, ct, row_map, weights.aval.dtype), weights)
    return ct_x, None, ct_w


def _weight_grad_transpose(ct, c, x, row_map, *, out_dtype):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_c = ct_x = None
    if ad.is_undefined_primal(c):
        ct_c = sum_to_batch(unpermute(x, row_map, ct, c.aval.dtype, has_weights=True), c)
    if ad.is_undefined_primal(x):
        ct_x = sum_to_batch(scatter(c, row_map, ct, x.aval.shape[1], x.aval.dtype, has_weights=True), x)
    return ct_c, ct_x, None


def _unpermute_tangent_jvp(primals, tangents, *, out_dtype):
    """unpermute(dx, w) + unpermute(x, dw) is bilinear in (dx, dw) against (x, w): each varying
    operand contributes one unpermute."""
    dx, dw, x, row_map, weights = primals
    out = unpermute_tangent_p.bind(dx, dw, x, row_map, weights, out_dtype=out_dtype)
    pairs = [(tangents[0], weights), (dx, tangents[4]), (tangents[2], dw), (x, tangents[1])]
    terms = [unpermute_p.bind(a, row_map, w, out_dtype=out_dtype, has_weights=True)
             for a, w in pairs if type(a) is not ad.Zero and type(w) is not ad.Zero]
    return out, _sum(terms, out)


def _unpermute_tangent_transpose(ct, dx, dw, x, row_map, weights, *, out_dtype):
    if type(ct) is ad.Zero:
        return None, None, None, None, None
    undefined = ad.is_undefined_primal
    ct_dx = ct_dw = ct_x = ct_w = None
    if undefined(dx) and undefined(dw):
        ct_dx, ct_dw = unpermute_bwd(ct, x, row_map, weights, dx.aval.dtype, dw.aval.dtype)
    elif undefined(dx):
        ct_dx = scatter(ct, row_map, weights, dx.aval.shape[1], dx.aval.dtype, has_weights=True)
    elif undefined(dw):
        ct_dw = weight_grad(ct, x, row_map, dw.aval.dtype)
    if undefined(x):  # the unpermute(x, dw) term
        ct_x = scatter(ct, row_map, dw, x.aval.shape[1], x.aval.dtype, has_weights=True)
    if undefined(weights):  # the unpermute(dx, w) term
        ct_w = weight_grad(ct, dx, row_map, weights.aval.dtype)
    operands = (dx, dw, x, row_map, weights)
    cts = (ct_dx, ct_dw, ct_x, None, ct_w)
    return tuple(None if c is None else sum_to_batch(c, o) for c, o in zip(cts, operands))


def _unpermute_bwd_jvp(primals, tangents, *, x_out_dtype, w_out_dtype):
    """scatter(c, w) is bilinear in (c, w), weight_grad(c, x) in (c, x)."""
    c, x, row_map, weights = primals
    dc, dx, _, dw = tangents
    outs = unpermute_bwd_p.bind(c, x, row_map, weights, x_out_dtype=x_out_dtype, w_out_dtype=w_out_dtype)
    scatter_of = lambda a, w: scatter_p.bind(a, row_map, w, num_rows=x.shape[1], out_dtype=x_out_dtype,
                                             has_weights=True)
    grad_of = lambda a, b: weight_grad_p.bind(a, b, row_map, out_dtype=w_out_dtype)
    tangent_outs = []
    for out, terms in zip(outs, ([(dc, weights, scatter_of), (c, dw, scatter_of)],
                                 [(dc, x, grad_of), (c, dx, grad_of)])):
        live = [f(a, b) for a, b, f in terms if type(a) is not ad.Zero and type(b) is not ad.Zero]
        tangent_outs.append(_sum(live, out))
    return outs, tangent_outs


# ---- moe_permute ----------------------------------------------------------------------------
permute_p.def_abstract_eval(shapes.permute)
_register_lowerings(permute_p, lowering.reference_permute, "permute", shapes.permute,
                    ("num_experts", "num_local_experts", "align_size", "has_map"), _permute_workspace)
batching.primitive_batchers[permute_p] = batcher(permute_p)
ad.primitive_jvps[permute_p] = _permute_jvp

# ---- moe_unpermute --------------------------------------------------------------------------
unpermute_p.def_abstract_eval(shapes.unpermute)
_register_lowerings(unpermute_p, lowering.reference_unpermute, "unpermute", shapes.unpermute, ("has_weights",))
batching.primitive_batchers[unpermute_p] = batcher(unpermute_p)
ad.primitive_jvps[unpermute_p] = _unpermute_jvp
ad.primitive_transposes[unpermute_p] = _unpermute_transpose

# ---- moe_unpermute_add (one launch on CUDA; unpermute + add elsewhere) -------------------------
unpermute_add_p.def_abstract_eval(shapes.unpermute_add)
_register_lowerings(unpermute_add_p, _composite_unpermute_add, "unpermute_add", shapes.unpermute_add,
                    ("has_weights",))
batching.primitive_batchers[unpermute_add_p] = batcher(unpermute_add_p)
ad.primitive_jvps[unpermute_add_p] = _unpermute_add_jvp
ad.primitive_transposes[unpermute_add_p] = _unpermute_add_transpose

# ---- moe_scatter ----------------------------------------------------------------------------
scatter_p.def_abstract_eval(shapes.scatter)
_register_lowerings(scatter_p, lowering.reference_scatter, "scatter", shapes.scatter, ("has_weights",),
                    _scatter_workspace)
batching.primitive_batchers[scatter_p] = batcher(scatter_p)
ad.primitive_jvps[scatter_p] = _bilinear_jvp(scatter_p, (0, 2))  # bilinear in (x, weights)
ad.primitive_transposes[scatter_p] = _scatter_transpose

# ---- moe_weight_grad ------------------------------------------------------------------------
weight_grad_p.def_abstract_eval(shapes.weight_grad)
_register_lowerings(weight_grad_p, lowering.reference_weight_grad, "weight_grad", shapes.weight_grad)
batching.primitive_batchers[weight_grad_p] = batcher(weight_grad_p)
ad.primitive_jvps[weight_grad_p] = _bilinear_jvp(weight_grad_p, (0, 1))  # bilinear in (c, x)
ad.primitive_transposes[weight_grad_p] = _weight_grad_transpose

# ---- moe_unpermute_tangent (composite everywhere: two unpermutes) ------------------------------
unpermute_tangent_p.def_abstract_eval(shapes.unpermute_tangent)
_register_lowerings(unpermute_tangent_p, _composite_unpermute_tangent)
batching.primitive_batchers[unpermute_tangent_p] = batcher(unpermute_tangent_p)
ad.primitive_jvps[unpermute_tangent_p] = _unpermute_tangent_jvp
ad.primitive_transposes[unpermute_tangent_p] = _unpermute_tangent_transpose

# ---- moe_unpermute_bwd (fused on CUDA, scatter + weight_grad elsewhere) -----------------------
unpermute_bwd_p.def_abstract_eval(shapes.unpermute_bwd)
_register_lowerings(unpermute_bwd_p, _composite_unpermute_bwd)
if _native.has_target("cuda", "unpermute_bwd"):
    mlir.register_lowering(unpermute_bwd_p, _fused_unpermute_bwd_rule(), platform="cuda")
batching.primitive_batchers[unpermute_bwd_p] = batcher(unpermute_bwd_p)
ad.primitive_jvps[unpermute_bwd_p] = _unpermute_bwd_jvp

# Their kernel lowerings partition under sharded jit (lowering.py).
require_devices_at_lowering(permute_p, unpermute_p, unpermute_add_p, scatter_p, weight_grad_p, unpermute_tangent_p,
                            unpermute_bwd_p)
