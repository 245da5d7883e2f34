"""The first grouped GEMM of the expert MLP with the token gather and the activation fused in:

  gather_gemm  (x [T, H], row_token [M] int32, group_sizes [G] int32, w [G, H, N])
               -> out [M, F] = act(x[row_token[r]] · w[g(r)]),   pre [M, N] = x[row_token[r]] · w[g(r)]

Row r belongs to group g(r) as in `ragged_dot` (group g holds the next group_sizes[g] rows);
rows past the sum, and rows whose token is outside [0, T), are zero in both outputs. Gated
activations (swiglu, geglu) take N = 2F columns [gate | up] and give act(gate) * up; gelu and
relu take N = F, and so does "none" (out = pre: a grouped GEMM of gathered rows). `pre` (the
pre-activation, what the backward keeps) is computed only when asked.

On sm_90 it lowers to one kernel (cpp/gemm/gather_gemm.cu: cp.async row gathers from x into the
wgmma operand, the activation in the epilogue), so the permuted copy [M, H] of the tokens and the
pre-activation are never written; elsewhere, or for shapes the kernel does not take, to the
unfused composition (a gather, `ragged_dot`, the activation), which also gives its derivatives
and its batching.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _native, gemm_primitives
from .batch_axis import bind_operands
from .grouped_gemm import ragged_dot

gather_gemm_p = Primitive("jax_moe_permute_gather_gemm")
gather_gemm_p.multiple_results = True

# layer.ACTIVATIONS in the kernel's numbering (moe_mlp_decode.h, MlpActivation).
# "none" (no activation, out = pre) makes the kernel a plain grouped GEMM whose rows are gathered.
ACTIVATION_CODES = {"swiglu": 0, "geglu": 1, "gelu": 2, "relu": 3, "none": 4}
_GATED = {"swiglu": True, "geglu": True, "gelu": False, "relu": False, "none": False}
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_fits(x, w, rows: int, activation: str) -> bool:
    """Whether the fused kernel takes these static shapes and dtypes (its launcher's own rule)."""
    if not (_native.has_target("cuda", "gather_gemm") and gemm_primitives.kernels_available()):
        return False
    if jnp.dtype(x.dtype) not in _KERNEL_DTYPES or w.dtype != x.dtype:
        return False
    (T, H), (G, _, N) = x.shape, w.shape
    return _native.kernel_fits("cuda", "gather_gemm", T, H, G, rows, N, ACTIVATION_CODES[activation])


# MOE_GATHER_GEMM (read at trace time): where `layer.moe_mlp` and `layer.expert_mlp` take the fused
# kernel. "forward" (the default): the forward pass, not the pass being differentiated, which runs
# the composition (measured faster for jit(grad): docs/layer.md, "The fused first GEMM"), and only
# for the group sizes of `forward_fuses`; "1": both passes, any group sizes; "0": neither. The
# primitive itself runs the kernel wherever it fits.
LAYER_MODES = ("forward", "1", "0")
# The layer's forward measured faster with the kernel than with permute + CUTLASS's tiles + the
# activation (H100; docs/layer.md, "When the layer uses it"): Qwen3-30B-A3B (F 768) at 256, 512 and
# 1024 rows a group, DeepSeek-V3 (F 2048) at 128 and 512. Mixtral (F 14336) tied at 1024 rows and
# lost at 4096, where CUTLASS's tiles run near the dense rate and the stages the kernel removes are
# a small share of the GEMM: wide experts keep CUTLASS's tiles from LONG_GROUP_ROWS rows a group.
# Below MIN_GROUP_ROWS, at decode-sized groups, CUTLASS's tiles win: forced on, a Qwen3 decode step
# on an H100 took 1.18x / 1.08x as long at T = 8 / 64 (0.5 and 4 rows a group; BENCHMARKS.md, "Decode").
MIN_GROUP_ROWS, LONG_GROUP_ROWS, MAX_GROUP_ROWS = 128, 512, 2048
FINE_GRAINED_FFN = 4096  # F (w_in's columns, halved when gated) up to which the long groups fuse


def forward_fuses(rows_per_group: float, ffn_size: int) -> bool:
    """Whether the default mode fuses a forward pass whose groups average `rows_per_group` rows for
    experts of `ffn_size` columns (F)."""
    if not MIN_GROUP_ROWS <= rows_per_group < MAX_GROUP_ROWS:
        return False
    return rows_per_group < LONG_GROUP_ROWS or ffn_size <= FINE_GRAINED_FFN


def backward_gathers(rows: int, groups: int, ffn_size: int) -> bool:
    """The default rule for the layer's backward reading its operands through the row index (the
    first GEMM's gathered weight gradient, the gathered second-GEMM backward): fine-grained experts
    (F <= FINE_GRAINED_FFN) whose `groups` groups average fewer than MAX_GROUP_ROWS of the `rows`."""
    return ffn_size <= FINE_GRAINED_FFN and rows < MAX_GROUP_ROWS * groups


def layer_enabled(differentiated: bool, rows_per_group: float, ffn_size: int) -> bool:
    """Whether the layer may take the fused kernel in this pass (MOE_GATHER_GEMM), for groups of
    `rows_per_group` rows on average and experts of `ffn_size` columns (F)."""
    mode = gemm_primitives.env_choice("MOE_GATHER_GEMM", LAYER_MODES)
    return mode == "1" or (mode == "forward" and not differentiated and forward_fuses(rows_per_group, ffn_size))


def layer_kernel_applies(x, w_in, rows: int, activation: str, differentiated: bool = False) -> bool:
    """Whether the layer (`moe_mlp`, `expert_mlp`) runs a first GEMM of `rows` rows read from x on
    the fused kernel: enabled for this pass and these groups, it fits, and the call is not
    decode-sized (those take the decode kernels)."""
    ffn_size = w_in.shape[2] // (2 if _GATED[activation] else 1)
    return (layer_enabled(differentiated, rows / w_in.shape[0], ffn_size) and rows > 0
            and kernel_fits(x, w_in, rows, activation)
            and not gemm_primitives.use_decode_kernel(1, rows, w_in.shape[0]))


def gather_gemm(x, row_token, group_sizes, w, *, activation: str, save_pre: bool = False):
    """(out [M, F], pre [M, N] or None); see the module docstring."""
    for name, a, ndim in (("x", x, 2), ("row_token", row_token, 1), ("group_sizes", group_sizes, 1), ("w", w, 3)):
        if not hasattr(a, "shape") or a.ndim != ndim:
            raise ValueError(f"gather_gemm: {name} must be a {ndim}-D array, got {getattr(a, 'shape', type(a))}")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"gather_gemm: activation must be one of {tuple(ACTIVATION_CODES)}, got {activation!r}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"gather_gemm: w must have shape [G, H, N] with H = {x.shape[1]} (from x), "
                         f"got {tuple(w.shape)}")
    if w.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"gather_gemm: group_sizes must have shape [G] = [{w.shape[0]}] (from w), "
                         f"got {tuple(group_sizes.shape)}")
    if _GATED[activation] and w.shape[2] % 2:
        raise ValueError(f"gather_gemm: w's last dimension must be even ([gate | up]) for {activation!r}, "
                         f"got {w.shape[2]}")
    for name, a in (("row_token", row_token), ("group_sizes", group_sizes)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"gather_gemm: {name} must be an integer array, got {a.dtype}")
    args = bind_operands(x, row_token.astype(jnp.int32), group_sizes.astype(jnp.int32), w.astype(x.dtype),
                         batched=False)
    out, pre = gather_gemm_p.bind(*args, activation=activation, save_pre=bool(save_pre))
    return out, (pre if save_pre else None)


def gathered_rows(x, row_token):
    """x[row_token[r]] for each row, zero where the token is outside [0, T)."""
    if x.shape[0] == 0:  # no tokens: every row is zero
        return jnp.zeros((row_token.shape[0], x.shape[1]), x.dtype)
    valid = (row_token >= 0) & (row_token < x.shape[0])
    rows = jnp.take(x, jnp.where(valid, row_token, 0), axis=0)
    return jnp.where(valid[:, None], rows, jnp.zeros((), x.dtype))


def _unfused(x, row_token, group_sizes, w, *, activation, save_pre):
    from .layer import apply_activation  # layer binds this primitive: import it when first used

    pre = ragged_dot(gathered_rows(x, row_token), w, group_sizes)
    out = pre if activation == "none" else apply_activation(pre, activation)
    return out, (pre if save_pre else jnp.zeros((0, w.shape[2]), x.dtype))


def _abstract(x, row_token, group_sizes, w, *, activation, save_pre):
    avals = (x, row_token, group_sizes, w)
    M, N = row_token.shape[0], w.shape[2]
    F = N // 2 if _GATED[activation] else N
    return (_compat.shaped_like(avals, (M, F), x.dtype),
            _compat.shaped_like(avals, (M if save_pre else 0, N), x.dtype))


# How the kernel hands out its tiles: MOE_GATHER_GEMM_SCHEDULE, read by the kernel at every launch
# (an A/B switch; cpp/gemm/gather_gemm.cu), checked here so that a typo fails when the call is lowered.
SCHEDULES = ("dynamic", "static")  # the first is the default


def check_schedule_variable() -> str:
    return gemm_primitives.env_choice("MOE_GATHER_GEMM_SCHEDULE", SCHEDULES)


def _lower_cuda(ctx, x, row_token, group_sizes, w, *, activation, save_pre):
    x_aval, token_aval, _, w_aval = ctx.avals_in
    if (not _compat.lowers_per_device(ctx) or token_aval.shape[0] == 0
            or not kernel_fits(x_aval, w_aval, token_aval.shape[0], activation)):
        return _lower_unfused(ctx, x, row_token, group_sizes, w, activation=activation, save_pre=save_pre)
    check_schedule_variable()
    # One more result: the kernel's tile counter (int32 scratch, zeroed by the handler).
    ctx = ctx.replace(avals_out=[*ctx.avals_out, core.ShapedArray((1,), jnp.int32)])
    call = jax.ffi.ffi_lowering(_native.target("gather_gemm"))
    return call(ctx, x, row_token, group_sizes, w, activation=np.int64(ACTIVATION_CODES[activation]),
                save_pre=np.int64(save_pre))[:-1]


def _batch(args, dims, *, activation, save_pre):
    """A vmapped call runs the unfused composition (whose ops batch into single launches)."""
    f = functools.partial(_unfused, activation=activation, save_pre=save_pre)
    return jax.vmap(f, in_axes=dims)(*args), (0, 0)


def _jvp(primals, tangents, *, activation, save_pre):
    """Derivatives through the unfused composition (our grouped GEMM and a gather)."""
    x, row_token, group_sizes, w = primals
    dx, _, _, dw = (ad.instantiate_zeros(t) for t in tangents)
    f = lambda x, w: _unfused(x, row_token, group_sizes, w, activation=activation, save_pre=save_pre)
    return jax.jvp(f, (x, w), (dx, dw))


_lower_unfused = mlir.lower_fun(_unfused, multiple_results=True)

gather_gemm_p.def_impl(jax.jit(gather_gemm_p.bind, static_argnames=("activation", "save_pre")))
gather_gemm_p.def_abstract_eval(_abstract)
mlir.register_lowering(gather_gemm_p, _lower_unfused)
batching.primitive_batchers[gather_gemm_p] = _batch
ad.primitive_jvps[gather_gemm_p] = _jvp
if _native.has_target("cuda", "gather_gemm"):
    mlir.register_lowering(gather_gemm_p, _lower_cuda, platform="cuda")


# ---- the weight gradient of the gathered rows ----------------------------------------------
#
#   gathered_wgrad (x [T, H], row_token [M], ct [M, N], group_sizes [G]) -> [G, H, N]
#                  out[g] = x[row_token[rows of g]]ᵀ · ct[rows of g]
#
# gather_gemm with activation "none" is linear in w; its transpose is this product, which the
# layer's backward takes for the first GEMM's weight gradient: on sm_90 our persistent dW kernel
# reads the rows of x through row_token (cpp/gemm/grouped_wgrad.cu, gathered lhs), so the permuted
# copy [M, H] of x is not recomputed in the backward; elsewhere the gather and `ragged_dot`'s
# weight gradient.

gathered_wgrad_p = Primitive("jax_moe_permute_gathered_wgrad")

# MOE_GATHERED_WGRAD (read at trace time): where the layer's backward takes the gathered weight
# gradient. "preferred" (the default): where the plain weight gradient would run our persistent
# kernel (groups averaging fewer rows than its long-group rule), and for fine-grained experts
# (F <= FINE_GRAINED_FFN) up to MAX_GROUP_ROWS rows a group; "1": wherever the kernel fits; "0":
# never (the rows gathered again and the plain weight gradient). Measured on an H100 (jit(grad),
# the layer bench): Qwen3-30B-A3B 0.98-0.99x the time at T = 4096 (256 rows a group) and at
# T = 16384 (1024 rows, where CUTLASS's tile runs the plain dW); Mixtral at 1024 rows 1.04-1.06x
# (CUTLASS's 128 x 128 tile on wide experts beats our kernel, gathered or not).
GATHERED_WGRAD_MODES = ("preferred", "1", "0")


def gathered_wgrad_kernel_fits(source, rows: int, k: int, n: int, groups: int) -> bool:
    """Whether gathered_wgrad lowers to the kernel for these static shapes and dtype (source: the
    gathered operand's [T, .] array)."""
    if not (_native.has_target("cuda", "gathered_wgrad_sm90") and gemm_primitives.kernels_available()):
        return False
    if jnp.dtype(source.dtype) not in _KERNEL_DTYPES or source.shape[0] == 0 or source.shape[0] >= 2**31:
        return False
    return _native.kernel_fits("cuda", "ragged_dot_wgrad_sm90", rows, k, n, groups)


def layer_gathers_wgrad(x, w_in, rows: int, activation: str) -> bool:
    """Whether the layer's backward takes gathered_wgrad (MOE_GATHERED_WGRAD) for the weight
    gradient of its first GEMM (x's `rows` rows through the routing, w_in [G, H, N])."""
    G, _, n = w_in.shape
    ffn_size = n // (2 if _GATED[activation] else 1)
    mode = gemm_primitives.env_choice("MOE_GATHERED_WGRAD", GATHERED_WGRAD_MODES)
    if mode == "0" or not gathered_wgrad_kernel_fits(x, rows, x.shape[1], n, G):
        return False
    return mode == "1" or gemm_primitives.use_own_wgrad_kernel(1, rows, x.shape[1], n, G,
                                                                preferred=backward_gathers(rows, G, ffn_size))


def gathered_wgrad(lhs, row_token, rhs, group_sizes, *, gather_rhs: bool = False):
    """[G, K, N]: lhs[rows of g]ᵀ · rhs[rows of g] for each group g, with the rows of lhs [T, K]
    (or, gather_rhs, of rhs [T, N]) read through row_token [M] (see above); the other operand has
    M rows."""
    args = bind_operands(lhs, row_token.astype(jnp.int32), rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32),
                         batched=False)
    return gathered_wgrad_p.bind(*args, gather_rhs=bool(gather_rhs))


def _wgrad_unfused(lhs, row_token, rhs, group_sizes, *, gather_rhs):
    lhs, rhs = (lhs, gathered_rows(rhs, row_token)) if gather_rhs else (gathered_rows(lhs, row_token), rhs)
    return gemm_primitives.ragged_dot_wgrad_bind(lhs[None], rhs[None], group_sizes[None], out_dtype=lhs.dtype,
                                                 precision=None)[0]


def _wgrad_abstract(lhs, row_token, rhs, group_sizes, *, gather_rhs):
    return _compat.shaped_like((lhs, row_token, rhs, group_sizes),
                               (group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), lhs.dtype)


def _lower_wgrad_cuda(ctx, lhs, row_token, rhs, group_sizes, *, gather_rhs):
    lhs_aval, token_aval, rhs_aval, sizes_aval = ctx.avals_in
    source = rhs_aval if gather_rhs else lhs_aval
    if (_compat.lowers_per_device(ctx) and rhs_aval.dtype == lhs_aval.dtype
            and gathered_wgrad_kernel_fits(source, token_aval.shape[0], lhs_aval.shape[1], rhs_aval.shape[1],
                                           sizes_aval.shape[0])):
        return jax.ffi.ffi_lowering(_native.target("gathered_wgrad_sm90"))(
            ctx, lhs, row_token, rhs, group_sizes, gather_rhs=np.int64(gather_rhs))
    return _lower_wgrad_unfused(ctx, lhs, row_token, rhs, group_sizes, gather_rhs=gather_rhs)


def _wgrad_batch(args, dims, *, gather_rhs):
    return jax.vmap(functools.partial(_wgrad_unfused, gather_rhs=gather_rhs), in_axes=dims)(*args), 0


def _wgrad_jvp(primals, tangents, *, gather_rhs):
    """Derivatives (higher orders of the layer) through the unfused composition."""
    lhs, row_token, rhs, group_sizes = primals
    d_lhs, _, d_rhs, _ = (ad.instantiate_zeros(t) for t in tangents)
    f = lambda a, b: _wgrad_unfused(a, row_token, b, group_sizes, gather_rhs=gather_rhs)
    return jax.jvp(f, (lhs, rhs), (d_lhs, d_rhs))


def _transpose(cts, x, row_token, group_sizes, w, *, activation, save_pre):
    """gather_gemm with activation "none" is linear in x and in w (not in both): d w is
    gathered_wgrad, d x the transposed composition."""
    if activation != "none" or ad.is_undefined_primal(x) == ad.is_undefined_primal(w):
        raise NotImplementedError(f"gather_gemm is linear in one of x, w only with activation 'none' ({activation!r})")
    live = [ct for ct in cts if type(ct) is not ad.Zero and ct.shape[0]]
    if not live:
        return None, None, None, None
    ct = sum(live[1:], live[0])
    if ad.is_undefined_primal(w):
        return None, None, None, gathered_wgrad(x, row_token, ct, group_sizes).astype(w.aval.dtype)
    f = lambda x: ragged_dot(gathered_rows(x, row_token), w, group_sizes)
    return jax.linear_transpose(f, jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype))(ct)[0], None, None, None


_lower_wgrad_unfused = mlir.lower_fun(_wgrad_unfused, multiple_results=False)

ad.primitive_transposes[gather_gemm_p] = _transpose
gathered_wgrad_p.def_impl(jax.jit(gathered_wgrad_p.bind, static_argnames=("gather_rhs",)))
gathered_wgrad_p.def_abstract_eval(_wgrad_abstract)
mlir.register_lowering(gathered_wgrad_p, _lower_wgrad_unfused)
batching.primitive_batchers[gathered_wgrad_p] = _wgrad_batch
ad.primitive_jvps[gathered_wgrad_p] = _wgrad_jvp
if _native.has_target("cuda", "gathered_wgrad_sm90"):
    mlir.register_lowering(gathered_wgrad_p, _lower_wgrad_cuda, platform="cuda")
