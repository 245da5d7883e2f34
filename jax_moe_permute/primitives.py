"""The four primitives behind the public ops, with abstract evaluation, lowering to our
XLA FFI targets, batching rules and autodiff rules.

  permute      (hidden, topk_ids, expert_map) -> (rows, group_sizes, row_map)
  unpermute    (x, row_map, weights) -> out[t] = sum_k w[t,k] x[row_map[t,k]]
  scatter      (x, row_map, weights) -> out[r] = sum_{row_map[t,k]=r} w[t,k] x[t]
  weight_grad  (c, x, row_map)       -> dw[t,k] = <c[t], x[row_map[t,k]]>
  unpermute_tangent (dx, dw, x, row_map, w) -> unpermute(dx, w) + unpermute(x, dw)
  unpermute_bwd     (c, x, row_map, w)      -> (scatter(c, w), weight_grad(c, x)) in one pass

unpermute_tangent is unpermute's JVP when both expert rows and weights vary: one linear
primitive, so that its transpose yields both cotangents at once (unpermute_bwd: on CUDA one
kernel reads each cotangent row once for both; elsewhere scatter + weight_grad).

unpermute and scatter are each other's transpose, weight_grad is their transpose with
respect to the weights, and permute's data movement is an unweighted scatter: the set is
closed under transposition, so derivatives of any order stay on our kernels.

Every operand carries a leading batch axis whose extent is the batch size B or 1 (a
broadcast operand, which the kernels read with batch stride 0). The public ops add it with
B = 1; the batching rule grows it, so a vmapped call is still one custom call per op.
An absent expert_map or weights operand is a [1, 1] / [1, 1, 1] placeholder flagged by the
static parameter has_map / has_weights.
"""

from __future__ import annotations

import inspect

import numpy as np
import jax
import jax.numpy as jnp
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _native, reference

# Dtypes the kernels write; the ops cast float8 outputs from float32 afterwards.
KERNEL_OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_ROWS = 2**31 - 1  # row_map is int32


def _batch(*avals) -> int:
    sizes = {a.shape[0] for a in avals}
    batch = max(sizes)
    if not sizes <= {1, batch}:
        raise ValueError(f"jax_moe_permute: inconsistent batch extents {sorted(sizes)}")
    return batch


def placeholder(ndim: int, dtype=jnp.float32) -> jax.Array:
    """The operand passed where expert_map / weights are absent."""
    return jnp.zeros((1,) * ndim, dtype)


# ---- abstract evaluation ------------------------------------------------------------------

def _permute_abstract(hidden, ids, expert_map, *, num_experts, num_local_experts, align_size, has_map):
    B = _batch(hidden, ids, expert_map)
    _, T, K = ids.shape
    if hidden.shape[1] != T:
        raise ValueError(f"moe_permute: hidden has {hidden.shape[1]} tokens (T) but topk_ids has {T}")
    if has_map and expert_map.shape[1] != num_experts:
        raise ValueError(f"moe_permute: expert_map must have shape ({num_experts},), got {tuple(expert_map.shape[1:])}")
    rows = reference.permuted_rows(T * K, num_local_experts, align_size)
    if rows > MAX_ROWS:
        raise ValueError(
            f"moe_permute: the permuted buffer would need {rows} rows (T*K={T * K}, align_size={align_size}); "
            f"row_map is int32, so at most {MAX_ROWS} rows are supported"
        )
    return (
        core.ShapedArray((B, rows, hidden.shape[2]), hidden.dtype),
        core.ShapedArray((B, num_local_experts), jnp.int32),
        core.ShapedArray((B, T, K), jnp.int32),
    )


def _check_weights(weights, row_map, has_weights, op):
    if has_weights and weights.shape[1:] != row_map.shape[1:]:
        raise ValueError(f"{op}: topk_weights shape {tuple(weights.shape[1:])} differs from row_map shape "
                         f"{tuple(row_map.shape[1:])}")


def _unpermute_abstract(x, row_map, weights, *, out_dtype, has_weights):
    _check_weights(weights, row_map, has_weights, "moe_unpermute")
    B = _batch(x, row_map, weights)
    return core.ShapedArray((B, row_map.shape[1], x.shape[2]), out_dtype)


def _scatter_abstract(x, row_map, weights, *, num_rows, out_dtype, has_weights):
    _check_weights(weights, row_map, has_weights, "moe_scatter")
    if x.shape[1] != row_map.shape[1]:
        raise ValueError(f"moe_scatter: x has {x.shape[1]} tokens but row_map has {row_map.shape[1]}")
    B = _batch(x, row_map, weights)
    return core.ShapedArray((B, num_rows, x.shape[2]), out_dtype)


def _weight_grad_abstract(c, x, row_map, *, out_dtype):
    if c.shape[1] != row_map.shape[1] or c.shape[2] != x.shape[2]:
        raise ValueError(f"moe_weight_grad: shapes {c.shape}, {x.shape}, {row_map.shape} disagree")
    B = _batch(c, x, row_map)
    return core.ShapedArray((B,) + row_map.shape[1:], out_dtype)


def _unpermute_tangent_abstract(dx, dw, x, row_map, weights, *, out_dtype):
    _check_weights(weights, row_map, 1, "moe_unpermute")
    B = _batch(dx, dw, x, row_map, weights)
    return core.ShapedArray((B, row_map.shape[1], x.shape[2]), out_dtype)


def _unpermute_bwd_abstract(c, x, row_map, weights, *, x_out_dtype, w_out_dtype):
    _check_weights(weights, row_map, 1, "moe_unpermute_bwd")
    B = _batch(c, x, row_map, weights)
    return (core.ShapedArray((B,) + x.shape[1:], x_out_dtype), core.ShapedArray((B,) + row_map.shape[1:], w_out_dtype))


def _primitive(name, abstract, multiple_results=False):
    p = Primitive(name)
    p.multiple_results = multiple_results
    # Eager calls run the op compiled on its own; one jitted bind per primitive, with the
    # static parameters (the abstract eval's keyword-only arguments) as cache keys.
    static = [n for n, a in inspect.signature(abstract).parameters.items() if a.kind == a.KEYWORD_ONLY]
    p.def_impl(jax.jit(p.bind, static_argnames=static))
    p.def_abstract_eval(abstract)
    return p


permute_p = _primitive("moe_permute", _permute_abstract, multiple_results=True)
unpermute_p = _primitive("moe_unpermute", _unpermute_abstract)
scatter_p = _primitive("moe_scatter", _scatter_abstract)
weight_grad_p = _primitive("moe_weight_grad", _weight_grad_abstract)
unpermute_tangent_p = _primitive("moe_unpermute_tangent", _unpermute_tangent_abstract)
unpermute_bwd_p = _primitive("moe_unpermute_bwd", _unpermute_bwd_abstract, multiple_results=True)


# ---- binding helpers (float8 outputs are produced in float32 and cast) -----------------

def _kernel_dtype(dtype):
    return jnp.dtype(dtype) if jnp.dtype(dtype) in map(jnp.dtype, KERNEL_OUT_DTYPES) else jnp.dtype(jnp.float32)


def unpermute(x, row_map, weights, has_weights, out_dtype):
    out = unpermute_p.bind(x, row_map, weights, out_dtype=_kernel_dtype(out_dtype), has_weights=has_weights)
    return out.astype(out_dtype)


def scatter(x, row_map, weights, has_weights, num_rows, out_dtype):
    out = scatter_p.bind(x, row_map, weights, num_rows=num_rows, out_dtype=_kernel_dtype(out_dtype),
                         has_weights=has_weights)
    return out.astype(out_dtype)


def weight_grad(c, x, row_map, out_dtype):
    return weight_grad_p.bind(c, x, row_map, out_dtype=_kernel_dtype(out_dtype)).astype(out_dtype)


def unpermute_bwd(c, x, row_map, weights, x_out_dtype, w_out_dtype):
    ct_x, ct_w = unpermute_bwd_p.bind(c, x, row_map, weights, x_out_dtype=_kernel_dtype(x_out_dtype),
                                      w_out_dtype=_kernel_dtype(w_out_dtype))
    return ct_x.astype(x_out_dtype), ct_w.astype(w_out_dtype)


# ---- lowering -----------------------------------------------------------------------------

def _ffi_rule(op, attrs, workspace=None):
    """Lowering to our FFI target for `op`, passing the static params named in `attrs` as
    int64 attributes. With `workspace(ctx) -> sizes`, the custom call gets one more uint8
    result sized by the platform module, which the primitive does not expose."""

    def lower(ctx, *args, platform, **params):
        call = jax.ffi.ffi_lowering(_native.target(op))
        attributes = {k: np.int64(params[k]) for k in attrs}
        if workspace is None:
            return call(ctx, *args, **attributes)
        nbytes = _native.workspace_bytes(platform, op, *workspace(ctx))
        ctx = ctx.replace(avals_out=[*ctx.avals_out, core.ShapedArray((max(nbytes, 1),), jnp.uint8)])
        return call(ctx, *args, **attributes)[:-1]

    return lower


def _permute_workspace(ctx):  # (batch, entries, local experts)
    B, T, K = ctx.avals_out[2].shape
    return B, T * K, ctx.avals_out[1].shape[1]


def _unpermute_bwd_workspace(ctx):  # (batch, entries, rows)
    B, R, _ = ctx.avals_out[0].shape
    _, T, K = ctx.avals_out[1].shape
    return B, T * K, R


def _scatter_workspace(ctx):  # (batch, entries, rows)
    B, R, _ = ctx.avals_out[0].shape
    _, T, K = ctx.avals_in[1].shape
    return B, T * K, R


_lower_permute = _ffi_rule("permute", ("num_experts", "num_local_experts", "align_size", "has_map"),
                           _permute_workspace)
_lower_unpermute = _ffi_rule("unpermute", ("has_weights",))
_lower_scatter = _ffi_rule("scatter", ("has_weights",), _scatter_workspace)
_lower_weight_grad = _ffi_rule("weight_grad", ())


# On platforms without our kernels, each primitive lowers through the jnp reference.
def _per_example(fn, args):
    """Applies single-example `fn` over the leading batch axis, broadcasting extent-1 operands."""
    B = max(a.shape[0] for a in args)
    if B == 1:
        outs = fn(*[a[0] for a in args])
        return jax.tree.map(lambda o: o[None], outs)
    axes = tuple(0 if a.shape[0] == B else None for a in args)
    args = [a if ax == 0 else a[0] for a, ax in zip(args, axes)]
    return jax.vmap(fn, in_axes=axes)(*args)


def _ref_permute(hidden, ids, expert_map, *, num_experts, num_local_experts, align_size, has_map):
    def one(h, i, m):
        return reference.moe_permute(h, i, num_experts, expert_map=m if has_map else None,
                                     num_local_experts=num_local_experts, align_size=align_size)
    return list(_per_example(one, [hidden, ids, expert_map]))


def _ref_unpermute(x, row_map, weights, *, out_dtype, has_weights):
    return _per_example(lambda a, r, w: reference.moe_unpermute(a, r, w if has_weights else None,
                                                                out_dtype=out_dtype), [x, row_map, weights])


def _ref_scatter(x, row_map, weights, *, num_rows, out_dtype, has_weights):
    def one(a, r, w):
        w = jnp.ones(r.shape, jnp.float32) if not has_weights else w.astype(jnp.float32)
        valid = (r >= 0) & (r < num_rows)
        contrib = a.astype(jnp.float32)[:, None, :] * jnp.where(valid, w, 0.0)[..., None]
        out = jnp.zeros((num_rows, a.shape[1]), jnp.float32).at[jnp.where(valid, r, num_rows)].add(
            contrib, mode="drop")
        return out.astype(out_dtype)
    return _per_example(one, [x, row_map, weights])


def _ref_weight_grad(c, x, row_map, *, out_dtype):
    def one(ct, a, r):
        valid = (r >= 0) & (r < a.shape[0])
        rows = jnp.take(a, jnp.where(valid, r, 0), axis=0).astype(jnp.float32)
        dots = jnp.sum(rows * ct.astype(jnp.float32)[:, None, :], axis=-1)
        return jnp.where(valid, dots, 0.0).astype(out_dtype)
    return _per_example(one, [c, x, row_map])


for _p, _lower, _ref, _multi in [
    (permute_p, _lower_permute, _ref_permute, True),
    (unpermute_p, _lower_unpermute, _ref_unpermute, False),
    (scatter_p, _lower_scatter, _ref_scatter, False),
    (weight_grad_p, _lower_weight_grad, _ref_weight_grad, False),
]:
    mlir.register_lowering(_p, mlir.lower_fun(_ref, multiple_results=_multi))
    for _platform in _native.platforms():
        mlir.register_lowering(_p, lambda ctx, *a, _l=_lower, _pl=_platform, **kw: _l(ctx, *a, platform=_pl, **kw),
                               platform=_platform)


def _composite_unpermute_tangent(dx, dw, x, row_map, weights, *, out_dtype):
    bind = lambda a, w: unpermute_p.bind(a, row_map, w, out_dtype=out_dtype, has_weights=1)
    return bind(dx, weights) + bind(x, dw)  # extents 1 and B broadcast


def _composite_unpermute_bwd(c, x, row_map, weights, *, x_out_dtype, w_out_dtype):
    B = _batch(c, x, row_map, weights)  # each half may see only extent-1 operands
    outs = [scatter_p.bind(c, row_map, weights, num_rows=x.shape[1], out_dtype=x_out_dtype, has_weights=1),
            weight_grad_p.bind(c, x, row_map, out_dtype=w_out_dtype)]
    return [jnp.broadcast_to(o, (B,) + o.shape[1:]) for o in outs]


mlir.register_lowering(unpermute_tangent_p, mlir.lower_fun(_composite_unpermute_tangent, multiple_results=False))
mlir.register_lowering(unpermute_bwd_p, mlir.lower_fun(_composite_unpermute_bwd, multiple_results=True))
if _native.has_target("cuda", "unpermute_bwd"):  # one pass for both cotangents
    _fused_bwd = _ffi_rule("unpermute_bwd", (), _unpermute_bwd_workspace)
    _composite_bwd = mlir.lower_fun(_composite_unpermute_bwd, multiple_results=True)

    def _lower_unpermute_bwd_cuda(ctx, *args, **params):
        wide = {jnp.dtype(d) for d in KERNEL_OUT_DTYPES}  # the fused kernel's input dtypes (not float8)
        if {a.dtype for a in ctx.avals_in[:2]} <= wide and ctx.avals_out[0].dtype == ctx.avals_in[1].dtype:
            return _fused_bwd(ctx, *args, platform="cuda", **params)
        return _composite_bwd(ctx, *args, **params)

    mlir.register_lowering(unpermute_bwd_p, _lower_unpermute_bwd_cuda, platform="cuda")


# ---- batching: fold the vmapped axis into the leading batch axis -------------------------

def _fold_vmap_axis(args, dims):
    """Moves each vmapped axis to the front and merges it with the leading batch axis."""
    V = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    B = max(a.shape[0] if d is None else a.shape[1] for a, d in zip(moved, dims))
    folded = []
    for a, d in zip(moved, dims):
        if d is None and (a.shape[0] == 1 or V == 1):
            folded.append(a)  # broadcast over the whole folded batch: no copy
            continue
        if d is None:
            a = jnp.broadcast_to(a[None], (V,) + a.shape)
        elif a.shape[1] != B:  # nested vmap: batched here, broadcast inside
            a = jnp.broadcast_to(a, (V, B) + a.shape[2:])
        folded.append(a.reshape((V * B,) + a.shape[2:]))
    return folded, V, B


def _batcher(p):
    def rule(args, dims, **params):
        folded, V, B = _fold_vmap_axis(args, dims)
        out = p.bind(*folded, **params)
        unfold = lambda o: o.reshape((V, o.shape[0] // V) + o.shape[1:])
        if p.multiple_results:
            return [unfold(o) for o in out], [0] * len(out)
        return unfold(out), 0
    return rule


for _p in (permute_p, unpermute_p, scatter_p, weight_grad_p, unpermute_tangent_p, unpermute_bwd_p):
    batching.primitive_batchers[_p] = _batcher(_p)


# ---- autodiff ------------------------------------------------------------------------------

def _zero_tangent(x):
    return ad.Zero(core.ShapedArray(x.shape, jax.dtypes.float0))


def _permute_jvp(primals, tangents, *, num_experts, num_local_experts, align_size, has_map):
    hidden, ids, expert_map = primals
    rows, group_sizes, row_map = permute_p.bind(hidden, ids, expert_map, num_experts=num_experts,
                                                num_local_experts=num_local_experts, align_size=align_size,
                                                has_map=has_map)
    d_hidden = tangents[0]
    if type(d_hidden) is ad.Zero:
        d_rows = ad.Zero(core.ShapedArray(rows.shape, rows.dtype))
    else:
        d_rows = scatter(d_hidden, row_map, placeholder(3), 0, rows.shape[1], rows.dtype)
    return (rows, group_sizes, row_map), (d_rows, _zero_tangent(group_sizes), _zero_tangent(row_map))


ad.primitive_jvps[permute_p] = _permute_jvp


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
        if not terms:
            return out, ad.Zero(core.ShapedArray(out.shape, out.dtype))
        return out, sum(terms[1:], terms[0])

    return jvp


def _sum_to_batch(ct, operand):
    """Cotangent of an operand broadcast over the batch (extent 1) sums over it."""
    shape = operand.aval.shape if ad.is_undefined_primal(operand) else operand.shape
    if shape[0] == 1 and ct.shape[0] != 1:
        ct = jnp.sum(ct, axis=0, keepdims=True, dtype=jnp.float32).astype(ct.dtype)
    return ct


def _unpermute_transpose(ct, x, row_map, weights, *, out_dtype, has_weights):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_x = ct_w = None
    if ad.is_undefined_primal(x):
        rows = x.aval.shape[1]
        ct_x = _sum_to_batch(scatter(ct, row_map, weights, has_weights, rows, x.aval.dtype), x)
    if ad.is_undefined_primal(weights):
        ct_w = _sum_to_batch(weight_grad(ct, x, row_map, weights.aval.dtype), weights)
    return ct_x, None, ct_w


def _scatter_transpose(ct, x, row_map, weights, *, num_rows, out_dtype, has_weights):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_x = ct_w = None
    if ad.is_undefined_primal(x):
        ct_x = _sum_to_batch(unpermute(ct, row_map, weights, has_weights, x.aval.dtype), x)
    if ad.is_undefined_primal(weights):
        ct_w = _sum_to_batch(weight_grad(x, ct, row_map, weights.aval.dtype), weights)
    return ct_x, None, ct_w


def _weight_grad_transpose(ct, c, x, row_map, *, out_dtype):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_c = ct_x = None
    if ad.is_undefined_primal(c):
        ct_c = _sum_to_batch(unpermute(x, row_map, ct, 1, c.aval.dtype), c)
    if ad.is_undefined_primal(x):
        ct_x = _sum_to_batch(scatter(c, row_map, ct, 1, x.aval.shape[1], x.aval.dtype), x)
    return ct_c, ct_x, None


# unpermute and scatter are bilinear in (x, weights); weight_grad in (c, x). An absent
# weights operand is a constant placeholder, so its tangent is always Zero.
for _p, _linear, _transpose in [
    (unpermute_p, (0, 2), _unpermute_transpose),
    (scatter_p, (0, 2), _scatter_transpose),
    (weight_grad_p, (0, 1), _weight_grad_transpose),
]:
    ad.primitive_jvps[_p] = _bilinear_jvp(_p, _linear)
    ad.primitive_transposes[_p] = _transpose


def _unpermute_jvp(primals, tangents, *, out_dtype, has_weights):
    """With both expert rows and weights varying, one unpermute_tangent (whose transpose is
    the fused backward) instead of two unpermutes transposed apart."""
    x, row_map, weights = primals
    dx, _, dw = tangents
    if type(dx) is ad.Zero or type(dw) is ad.Zero:
        return _bilinear_jvp(unpermute_p, (0, 2))(primals, tangents, out_dtype=out_dtype, has_weights=has_weights)
    out = unpermute_p.bind(x, row_map, weights, out_dtype=out_dtype, has_weights=has_weights)
    return out, unpermute_tangent_p.bind(dx, dw, x, row_map, weights, out_dtype=out_dtype)


ad.primitive_jvps[unpermute_p] = _unpermute_jvp


def _unpermute_tangent_jvp(primals, tangents, *, out_dtype):
    """unpermute(dx, w) + unpermute(x, dw) is bilinear in (dx, dw) against (x, w): each varying
    operand contributes one unpermute."""
    dx, dw, x, row_map, weights = primals
    out = unpermute_tangent_p.bind(dx, dw, x, row_map, weights, out_dtype=out_dtype)
    pairs = [(tangents[0], weights), (dx, tangents[4]), (tangents[2], dw), (x, tangents[1])]
    terms = [unpermute_p.bind(a, row_map, w, out_dtype=out_dtype, has_weights=1)
             for a, w in pairs if type(a) is not ad.Zero and type(w) is not ad.Zero]
    if not terms:
        return out, ad.Zero(core.ShapedArray(out.shape, out.dtype))
    return out, sum(terms[1:], terms[0])


def _unpermute_tangent_transpose(ct, dx, dw, x, row_map, weights, *, out_dtype):
    if type(ct) is ad.Zero:
        return None, None, None, None, None
    undefined = ad.is_undefined_primal
    ct_dx = ct_dw = ct_x = ct_w = None
    if undefined(dx) and undefined(dw):
        ct_dx, ct_dw = unpermute_bwd(ct, x, row_map, weights, dx.aval.dtype, dw.aval.dtype)
    elif undefined(dx):
        ct_dx = scatter(ct, row_map, weights, 1, dx.aval.shape[1], dx.aval.dtype)
    elif undefined(dw):
        ct_dw = weight_grad(ct, x, row_map, dw.aval.dtype)
    if undefined(x):  # the unpermute(x, dw) term
        ct_x = scatter(ct, row_map, dw, 1, x.aval.shape[1], x.aval.dtype)
    if undefined(weights):  # the unpermute(dx, w) term
        ct_w = weight_grad(ct, dx, row_map, weights.aval.dtype)
    operands = (dx, dw, x, row_map, weights)
    cts = (ct_dx, ct_dw, ct_x, None, ct_w)
    return tuple(None if c is None else _sum_to_batch(c, o) for c, o in zip(cts, operands))


def _unpermute_bwd_jvp(primals, tangents, *, x_out_dtype, w_out_dtype):
    """scatter(c, w) is bilinear in (c, w), weight_grad(c, x) in (c, x)."""
    c, x, row_map, weights = primals
    dc, dx, _, dw = tangents
    outs = unpermute_bwd_p.bind(c, x, row_map, weights, x_out_dtype=x_out_dtype, w_out_dtype=w_out_dtype)
    scatter_of = lambda a, w: scatter_p.bind(a, row_map, w, num_rows=x.shape[1], out_dtype=x_out_dtype, has_weights=1)
    grad_of = lambda a, b: weight_grad_p.bind(a, b, row_map, out_dtype=w_out_dtype)
    tangent_outs = []
    for out, terms in zip(outs, ([(dc, weights, scatter_of), (c, dw, scatter_of)],
                                 [(dc, x, grad_of), (c, dx, grad_of)])):
        live = [f(a, b) for a, b, f in terms if type(a) is not ad.Zero and type(b) is not ad.Zero]
        tangent_outs.append(sum(live[1:], live[0]) if live else ad.Zero(core.ShapedArray(out.shape, out.dtype)))
    return outs, tangent_outs


ad.primitive_jvps[unpermute_tangent_p] = _unpermute_tangent_jvp
ad.primitive_transposes[unpermute_tangent_p] = _unpermute_tangent_transpose
ad.primitive_jvps[unpermute_bwd_p] = _unpermute_bwd_jvp
