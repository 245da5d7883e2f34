"""The two primitives behind `jax_moe_permute.ragged_dot`, with abstract evaluation, lowering
(our CUTLASS grouped GEMM on sm_90, jax.lax.ragged_dot elsewhere), batching and autodiff rules.

  ragged_dot         (lhs [B, M, K], rhs [B, G, K, N], group_sizes [B, G]) -> out [B, M, N]
                     out[b, rows of g] = lhs[b, rows of g] · rhs[b, g]
                     (rhs_transposed: rhs [B, G, N, K] and out[b, rows of g] = lhs[...] · rhs[b, g]ᵀ)
  ragged_dot_wgrad   (lhs [B, M, K], rhs [B, M, N], group_sizes [B, G]) -> out [B, G, K, N]
                     out[b, g] = lhs[b, rows of g]ᵀ · rhs[b, rows of g]

Group g holds the next group_sizes[g] rows after those of groups < g; rows past the sum give
zero output rows (ragged_dot) and contribute nothing (ragged_dot_wgrad); groups without rows
give zero weight gradients. Both are bilinear in (lhs, rhs) and each one's transposes are the
other or itself with rhs_transposed flipped, so derivatives of any order stay on these kernels:

  d lhs of ragged_dot        = ragged_dot(ct, rhs, rhs_transposed=not rhs_transposed)
  d rhs of ragged_dot        = ragged_dot_wgrad(lhs, ct)   (wgrad(ct, lhs) when rhs_transposed)
  d lhs of ragged_dot_wgrad  = ragged_dot(rhs, ct, rhs_transposed=True)
  d rhs of ragged_dot_wgrad  = ragged_dot(lhs, ct)

Every operand carries a leading batch axis of extent B or 1 (broadcast, read with batch
stride 0), as the permute primitives do: a vmapped call is one launch of B * G problems.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import jax
import jax.numpy as jnp
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from . import _compat, _native
from .batch_axis import batch_extent, batcher, bind_operands, sum_to_batch
from .explicit_sharding import on_explicit_mesh, resharded

ragged_dot_p = Primitive("jax_moe_permute_ragged_dot")
ragged_dot_wgrad_p = Primitive("jax_moe_permute_ragged_dot_wgrad")

# Element types of the CUTLASS kernels (inputs and output alike), with the codes of grouped_gemm.h.
_KERNEL_DTYPES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
_LAYOUT_FORWARD, _LAYOUT_TRANSPOSED_RHS, _LAYOUT_WEIGHT_GRAD = 0, 1, 2
_INT32_MAX = 2**31 - 1


# ---- abstract evaluation ------------------------------------------------------------------

def _ragged_dot_abstract(lhs, rhs, group_sizes, *, rhs_transposed, out_dtype, precision):
    n = rhs.shape[2] if rhs_transposed else rhs.shape[3]
    shape = (batch_extent(lhs, rhs, group_sizes), lhs.shape[1], n)
    return _compat.shaped_like((lhs, rhs, group_sizes), shape, out_dtype)


def _ragged_dot_wgrad_abstract(lhs, rhs, group_sizes, *, out_dtype, precision):
    shape = (batch_extent(lhs, rhs, group_sizes), group_sizes.shape[1], lhs.shape[2], rhs.shape[2])
    return _compat.shaped_like((lhs, rhs, group_sizes), shape, out_dtype)


# ---- reference lowering (CPU, other GPUs, unsupported dtypes or shapes) ---------------------

def _common_dtype(a, b):
    """jax.lax's dots take one input dtype; a float32 cotangent meets bfloat16 weights in AD."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


# jax.lax.ragged_dot_general's dimension numbers, per example and over the leading batch axis (as
# jax.vmap emits them): lhs [M, K] · rhs [G, K, N] -> [M, N]; the weight gradient lhs [M, K] ·
# rhs [M, N] contracted along the ragged M -> [G, K, N], batched [G, B, K, N] (the group axis first).
_FORWARD_DIMS = (jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]),
    jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [2]), ([0], [0])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[1]))
_WGRAD_DIMS = (jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]),
    jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([0], [0])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]))


def _batched_ragged_dot(lhs, rhs, group_sizes, dims, example_ndim, batch_axis, *, out_dtype, precision):
    """jax.lax.ragged_dot_general over the leading batch axis: one example's call for B = 1, else
    one call over the batch (extent-1 operands broadcast; the result's batch axis at `batch_axis`,
    moved to the front). On a mesh with Explicit axes its result's sharding must be named (ours,
    `_compat.shaped_like`: the batch axis as the operands', no other) and the operands' batch axes
    sharded alike."""
    B = max(a.shape[0] for a in (lhs, rhs, group_sizes))
    lhs, rhs = _common_dtype(lhs, rhs)
    operands = [lhs, rhs, group_sizes]
    avals = [jax.typeof(a) for a in operands]
    mesh = next((a.sharding for a in avals if on_explicit_mesh(a)), None)  # a sharding on the explicit mesh
    lead = next(a.sharding.spec[0] for a in avals if a.shape[0] == B) if mesh is not None else None
    call = functools.partial(jax.lax.ragged_dot_general, precision=precision, preferred_element_type=out_dtype)
    if B == 1:
        out_sharding = None if mesh is None else mesh.update(spec=PartitionSpec(*(None,) * example_ndim))
        return call(*(a[0] for a in operands), dims[0], out_sharding=out_sharding)[None]
    operands = [jnp.broadcast_to(a, (B,) + a.shape[1:]) for a in operands]
    out_sharding = None
    if mesh is not None:
        operands = [resharded(a, (lead,) + (None,) * (a.ndim - 1), mesh) for a in operands]
        spec = [None] * (example_ndim + 1)
        spec[batch_axis] = lead
        out_sharding = mesh.update(spec=PartitionSpec(*spec))
    return jnp.moveaxis(call(*operands, dims[1], out_sharding=out_sharding), batch_axis, 0)


def _ref_ragged_dot(lhs, rhs, group_sizes, *, rhs_transposed, out_dtype, precision):
    rhs = jnp.swapaxes(rhs, 2, 3) if rhs_transposed else rhs
    return _batched_ragged_dot(lhs, rhs, group_sizes, _FORWARD_DIMS, 2, 0, out_dtype=out_dtype, precision=precision)


def _ref_ragged_dot_wgrad(lhs, rhs, group_sizes, *, out_dtype, precision):
    return _batched_ragged_dot(lhs, rhs, group_sizes, _WGRAD_DIMS, 3, 1, out_dtype=out_dtype, precision=precision)


_lower_ref_ragged_dot = mlir.lower_fun(_ref_ragged_dot, multiple_results=False)
_lower_ref_ragged_dot_wgrad = mlir.lower_fun(_ref_ragged_dot_wgrad, multiple_results=False)


# ---- CUDA lowering: our FFI targets on sm_90 -------------------------------------------------

@functools.cache
def gpu_is_sm90() -> bool:
    """Whether the first GPU is a Hopper (sm_90): the CUTLASS units are built for sm_90a only."""
    try:
        return str(getattr(jax.devices("gpu")[0], "compute_capability", "")) == "9.0"
    except RuntimeError:
        return False


def kernels_available() -> bool:
    """Whether ragged_dot runs on our grouped GEMM here (else it lowers to jax.lax.ragged_dot)."""
    return _native.has_target("cuda", "ragged_dot") and gpu_is_sm90()


def _kernel_fits(avals_in, aval_out, k: int, n: int) -> bool:
    """The kernels take bf16/f16 inputs and output of one dtype, 16-byte rows (K, N multiples
    of 8 elements for TMA) and int32 problem extents."""
    dtypes = {a.dtype for a in avals_in[:2]} | {aval_out.dtype}
    extents_ok = all(d <= _INT32_MAX for a in avals_in for d in a.shape)
    return (len(dtypes) == 1 and aval_out.dtype in _KERNEL_DTYPES and k % 8 == 0 and n % 8 == 0
            and extents_ok and avals_in[2].dtype == jnp.int32 and kernels_available())


def _ffi_call(ctx, target, layout, args, **attributes):
    """Our FFI target with one more uint8 result: the setup kernel's per-problem arrays and
    CUTLASS's workspace (no allocation in the handler)."""
    batch = ctx.avals_out[0].shape[0]
    groups = ctx.avals_in[2].shape[1]
    nbytes = _native.workspace_bytes("cuda", "ragged_dot", layout, _KERNEL_DTYPES[ctx.avals_out[0].dtype],
                                     batch * groups, batch)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, core.ShapedArray((max(int(nbytes), 1),), jnp.uint8)])
    return jax.ffi.ffi_lowering(_native.target(target))(ctx, *args, **attributes)[:-1]


# The forward GEMM runs on the decode kernel (CUDA cores streaming each routed matrix, split along
# its rows; graph-safe) while there are at most this many rows per group (Qwen3 and DeepSeek-V3 at
# T = 1: measured faster there), on CUTLASS's tiles above (faster from half a row per group, Qwen3
# at T = 8; BENCHMARKS.md, "Decode").
DECODE_ROWS_PER_GROUP = 0.25
MAX_GRID_Y = 65535


def use_decode_kernel(batch: int, rows: int, groups: int) -> bool:
    """Static choice of the forward GEMM's kernel; MOE_GROUPED_GEMM_TILE, read when the call is
    lowered, forces it ("decode") or a CUTLASS tile (any other value). The same rule picks the
    fused decode MLP (decode_mlp.py) for a whole moe_mlp call, when it is traced."""
    if min(groups, rows) + 1 > MAX_GRID_Y or batch > MAX_GRID_Y:
        return False
    forced = os.environ.get("MOE_GROUPED_GEMM_TILE")
    if forced is not None:
        return forced == "decode"
    return rows <= DECODE_ROWS_PER_GROUP * groups


def _lower_ragged_dot_decode(ctx, lhs, rhs, group_sizes):
    (batch, rows, n), k, groups = ctx.avals_out[0].shape, ctx.avals_in[0].shape[2], ctx.avals_in[2].shape[1]
    nbytes = _native.workspace_bytes("cuda", "ragged_dot_decode", batch, groups, rows, k, n)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, core.ShapedArray((max(int(nbytes), 1),), jnp.uint8)])
    return jax.ffi.ffi_lowering(_native.target("ragged_dot_decode"))(ctx, lhs, rhs, group_sizes)[:-1]


def _lower_ragged_dot_cuda(ctx, lhs, rhs, group_sizes, *, rhs_transposed, out_dtype, precision):
    out = ctx.avals_out[0]
    if not _kernel_fits(ctx.avals_in, out, ctx.avals_in[0].shape[2], out.shape[2]):
        return _lower_ref_ragged_dot(ctx, lhs, rhs, group_sizes, rhs_transposed=rhs_transposed,
                                     out_dtype=out_dtype, precision=precision)
    if not rhs_transposed and use_decode_kernel(out.shape[0], out.shape[1], ctx.avals_in[2].shape[1]):
        return _lower_ragged_dot_decode(ctx, lhs, rhs, group_sizes)
    layout = _LAYOUT_TRANSPOSED_RHS if rhs_transposed else _LAYOUT_FORWARD
    return _ffi_call(ctx, "ragged_dot", layout, (lhs, rhs, group_sizes), rhs_transposed=np.int64(rhs_transposed))


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, one of `choices` (the first when unset); anything else raises a
    ValueError naming it. The kernels' A/B switches are checked this way when a call is lowered."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


DW_KERNELS = ("auto", "cutlass", "persistent")
# The persistent kernel's epilogues, read by the kernel at every launch (cpp/gemm/grouped_wgrad.cu;
# an A/B switch, checked here so that a typo fails when the call is lowered).
DW_EPILOGUES = ("tma", "registers")  # the first is the default


def use_own_wgrad_kernel(batch: int, rows: int, k: int, n: int, groups: int, preferred: bool = False) -> bool:
    """Static choice of the weight gradient's kernel, made when the call is lowered: our persistent
    one (cpp/gemm/grouped_wgrad.cu, graph-safe) where it fits and the groups average fewer than
    1024 rows (the fine-grained MoEs, where it measured 0.97-1.42x CUTLASS's rate) or the caller
    prefers it (`preferred`: its own measurements), CUTLASS's otherwise.
    MOE_GROUPED_GEMM_DW_KERNEL=cutlass or =persistent forces one where it fits; forcing a CUTLASS
    tile (MOE_GROUPED_GEMM_DW_TILE) implies CUTLASS."""
    choice = env_choice("MOE_GROUPED_GEMM_DW_KERNEL", DW_KERNELS)
    env_choice("MOE_SM90_WGRAD_EPILOGUE", DW_EPILOGUES)
    if choice == "cutlass" or batch != 1 or not _native.has_target("cuda", "ragged_dot_wgrad_sm90"):
        return False
    if choice == "persistent":
        return _native.kernel_fits("cuda", "ragged_dot_wgrad_sm90", rows, k, n, groups)
    if os.environ.get("MOE_GROUPED_GEMM_DW_TILE") is not None:
        return False
    if preferred:
        return _native.kernel_fits("cuda", "ragged_dot_wgrad_sm90", rows, k, n, groups)
    return _native.kernel_preferred("cuda", "ragged_dot_wgrad_sm90", rows, k, n, groups)


def _lower_ragged_dot_wgrad_cuda(ctx, lhs, rhs, group_sizes, *, out_dtype, precision):
    out = ctx.avals_out[0]
    if not _kernel_fits(ctx.avals_in, out, out.shape[2], out.shape[3]):
        return _lower_ref_ragged_dot_wgrad(ctx, lhs, rhs, group_sizes, out_dtype=out_dtype, precision=precision)
    batch, groups, k, n = out.shape
    if use_own_wgrad_kernel(batch, ctx.avals_in[0].shape[1], k, n, groups):
        return jax.ffi.ffi_lowering(_native.target("ragged_dot_wgrad_sm90"))(ctx, lhs, rhs, group_sizes)
    return _ffi_call(ctx, "ragged_dot_weight_grad", _LAYOUT_WEIGHT_GRAD, (lhs, rhs, group_sizes))


# ---- autodiff ------------------------------------------------------------------------------

def _bilinear_jvp(p):
    """JVP of a primitive linear in lhs and in rhs separately (group_sizes is an integer)."""

    def jvp(primals, tangents, **params):
        lhs, rhs, group_sizes = primals
        d_lhs, d_rhs, _ = tangents
        out = p.bind(*primals, **params)
        terms = []
        if type(d_lhs) is not ad.Zero:
            terms.append(p.bind(*bind_operands(d_lhs, rhs, group_sizes), **params))
        if type(d_rhs) is not ad.Zero:
            terms.append(p.bind(*bind_operands(lhs, d_rhs, group_sizes), **params))
        if not terms:
            return out, ad.Zero(core.ShapedArray(out.shape, out.dtype))
        return out, sum(terms[1:], terms[0])

    return jvp


def _dtype_of(x):
    return x.aval.dtype if ad.is_undefined_primal(x) else x.dtype


def ragged_dot_bind(lhs, rhs, group_sizes, *, rhs_transposed, out_dtype, precision):
    lhs, rhs, group_sizes = bind_operands(lhs, rhs, group_sizes)
    return ragged_dot_p.bind(lhs, rhs, group_sizes, rhs_transposed=bool(rhs_transposed),
                             out_dtype=jnp.dtype(out_dtype), precision=precision)


def ragged_dot_wgrad_bind(lhs, rhs, group_sizes, *, out_dtype, precision):
    lhs, rhs, group_sizes = bind_operands(lhs, rhs, group_sizes)
    return ragged_dot_wgrad_p.bind(lhs, rhs, group_sizes, out_dtype=jnp.dtype(out_dtype), precision=precision)


def _ragged_dot_transpose(ct, lhs, rhs, group_sizes, *, rhs_transposed, out_dtype, precision):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_lhs = ct_rhs = None
    if ad.is_undefined_primal(lhs):
        ct_lhs = ragged_dot_bind(ct, rhs, group_sizes, rhs_transposed=not rhs_transposed,
                                 out_dtype=_dtype_of(lhs), precision=precision)
        ct_lhs = sum_to_batch(ct_lhs, lhs)
    if ad.is_undefined_primal(rhs):
        a, b = (ct, lhs) if rhs_transposed else (lhs, ct)
        ct_rhs = ragged_dot_wgrad_bind(a, b, group_sizes, out_dtype=_dtype_of(rhs), precision=precision)
        ct_rhs = sum_to_batch(ct_rhs, rhs)
    return ct_lhs, ct_rhs, None


def _ragged_dot_wgrad_transpose(ct, lhs, rhs, group_sizes, *, out_dtype, precision):
    if type(ct) is ad.Zero:
        return None, None, None
    ct_lhs = ct_rhs = None
    if ad.is_undefined_primal(lhs):  # d lhs[rows of g] = rhs[rows of g] · ct[g]ᵀ
        ct_lhs = ragged_dot_bind(rhs, ct, group_sizes, rhs_transposed=True, out_dtype=_dtype_of(lhs),
                                 precision=precision)
        ct_lhs = sum_to_batch(ct_lhs, lhs)
    if ad.is_undefined_primal(rhs):  # d rhs[rows of g] = lhs[rows of g] · ct[g]
        ct_rhs = ragged_dot_bind(lhs, ct, group_sizes, rhs_transposed=False, out_dtype=_dtype_of(rhs),
                                 precision=precision)
        ct_rhs = sum_to_batch(ct_rhs, rhs)
    return ct_lhs, ct_rhs, None


# ---- registration: each primitive's rules in one block ------------------------------------

# Eager calls run the primitive compiled on its own.
ragged_dot_p.def_impl(jax.jit(ragged_dot_p.bind, static_argnames=("rhs_transposed", "out_dtype", "precision")))
ragged_dot_p.def_abstract_eval(_ragged_dot_abstract)
mlir.register_lowering(ragged_dot_p, _lower_ref_ragged_dot)
batching.primitive_batchers[ragged_dot_p] = batcher(ragged_dot_p)
ad.primitive_jvps[ragged_dot_p] = _bilinear_jvp(ragged_dot_p)
ad.primitive_transposes[ragged_dot_p] = _ragged_dot_transpose

ragged_dot_wgrad_p.def_impl(jax.jit(ragged_dot_wgrad_p.bind, static_argnames=("out_dtype", "precision")))
ragged_dot_wgrad_p.def_abstract_eval(_ragged_dot_wgrad_abstract)
mlir.register_lowering(ragged_dot_wgrad_p, _lower_ref_ragged_dot_wgrad)
batching.primitive_batchers[ragged_dot_wgrad_p] = batcher(ragged_dot_wgrad_p)
ad.primitive_jvps[ragged_dot_wgrad_p] = _bilinear_jvp(ragged_dot_wgrad_p)
ad.primitive_transposes[ragged_dot_wgrad_p] = _ragged_dot_wgrad_transpose

if _native.has_target("cuda", "ragged_dot"):
    mlir.register_lowering(ragged_dot_p, _lower_ragged_dot_cuda, platform="cuda")
    mlir.register_lowering(ragged_dot_wgrad_p, _lower_ragged_dot_wgrad_cuda, platform="cuda")


# ---- ragged_dot_stacked: the forward GEMM on one layer of a stacked rhs ---------------------
#
#   ragged_dot_stacked  (lhs [1, M, K], rhs [NL, G, K, N], group_sizes [1, G], layer [] int32)
#                       -> out [1, M, N] = ragged_dot(lhs, rhs[layer], group_sizes)
#
# On sm_90 the CUTLASS kernel's setup kernel reads the layer on the device (no XLA slice of the
# stack: XLA passes a dynamic slice to a custom call by copying its offset to the host and waiting).
# Elsewhere, for decode-sized groups and under transformations: the slice and ragged_dot. It is
# the primal of moe_mlp's stacked forward; derivatives go through moe_mlp's JVP rule.

ragged_dot_stacked_p = Primitive("jax_moe_permute_ragged_dot_stacked")


def _stacked_composition(lhs, rhs, group_sizes, layer):
    rhs = jax.lax.dynamic_index_in_dim(rhs, layer, 0, keepdims=True)
    return ragged_dot_bind(lhs, rhs, group_sizes, rhs_transposed=False, out_dtype=lhs.dtype, precision=None)


def _stacked_abstract(lhs, rhs, group_sizes, layer):
    return _compat.shaped_like((lhs, group_sizes), (1, lhs.shape[1], rhs.shape[3]), lhs.dtype)


def _lower_stacked_cuda(ctx, lhs, rhs, group_sizes, layer):
    out, (_, rows, k), groups = ctx.avals_out[0], ctx.avals_in[0].shape, ctx.avals_in[2].shape[1]
    if not _kernel_fits(ctx.avals_in[:3], out, k, out.shape[2]) or use_decode_kernel(1, rows, groups):
        return _lower_stacked_composition(ctx, lhs, rhs, group_sizes, layer)
    return _ffi_call(ctx, "ragged_dot_stacked", _LAYOUT_FORWARD, (lhs, rhs, group_sizes, layer))


def _stacked_batch(args, dims):
    return jax.vmap(_stacked_composition, in_axes=dims)(*args), 0


def _stacked_jvp(primals, tangents):
    return jax.jvp(_stacked_composition, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents))


_lower_stacked_composition = mlir.lower_fun(_stacked_composition, multiple_results=False)

ragged_dot_stacked_p.def_impl(jax.jit(ragged_dot_stacked_p.bind))
ragged_dot_stacked_p.def_abstract_eval(_stacked_abstract)
mlir.register_lowering(ragged_dot_stacked_p, _lower_stacked_composition)
batching.primitive_batchers[ragged_dot_stacked_p] = _stacked_batch
ad.primitive_jvps[ragged_dot_stacked_p] = _stacked_jvp
if _native.has_target("cuda", "ragged_dot_stacked"):
    mlir.register_lowering(ragged_dot_stacked_p, _lower_stacked_cuda, platform="cuda")
