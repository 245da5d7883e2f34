"""The routed experts' MLP of a decode step as one primitive, from the tokens to the weighted sum:

  moe_mlp_decode  (x [T, H], weights [T, K] float32, ids [T, K] int32, w_in [L, H, C], w_out [L, F, H'])
                  -> out [T, H'] = sum_k weights[t, k] * MLP_{ids[t, k]}(x[t])
  moe_mlp_decode  (..., w_in [NL, L, H, C], w_out [NL, L, F, H'], layer [] int32)  (stacked)
                  -> the same with w_in[layer], w_out[layer]
  moe_mlp_decode  (..., residual [T, H'])  (with_residual, either form)
                  -> residual + out: a decoder block's residual add, in the kernels' last launch

On sm_90 it lowers to the fused decode kernels (cpp/gemm/moe_mlp_decode.cu: two launches in place of
permute, two grouped GEMMs with their partial sums, the activation and the weighted unpermute),
elsewhere to that unfused composition. `layer.moe_mlp` binds it for decode-sized calls only (the
rule of the forward GEMM's decode kernel, `gemm_primitives.DECODE_ROWS_PER_GROUP`), and only as
the primal of its JVP rule: derivatives go through the unfused path. Ids outside [0, L)
contribute nothing (expert_map is applied before the bind).

The stacked form takes a model's weights stacked over its layers and the layer as a device
scalar, which the kernels read on the device: in a `lax.scan` over layers XLA would otherwise pass
the custom call a dynamic slice of the stack, whose offset it copies to the host and waits for at
every layer (its DynamicSliceThunk), leaving a decode step host-bound.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _native, gemm_primitives, ops
from .batch_axis import bind_operands

moe_mlp_decode_p = Primitive("jax_moe_permute_moe_mlp_decode")

# layer.ACTIVATIONS in the kernel's numbering (moe_mlp_decode.h, MlpActivation).
ACTIVATION_CODES = {"swiglu": 0, "geglu": 1, "gelu": 2, "relu": 3}
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _kernel_fits(x, ids, w_in, w_out) -> bool:
    """Our CUDA module on an sm_90 GPU, bf16/f16 throughout, 16-byte rows, a grid of pairs (w_in
    and w_out one layer's or stacked)."""
    if not (_native.has_target("cuda", "moe_mlp_decode") and gemm_primitives.kernels_available()):
        return False
    (T, H), K, C, H_out = x.shape, ids.shape[1], w_in.shape[-1], w_out.shape[-1]
    dtypes_ok = jnp.dtype(x.dtype) in _KERNEL_DTYPES and w_in.dtype == x.dtype and w_out.dtype == x.dtype
    pairs_ok = 0 < T * K <= gemm_primitives.MAX_GRID_Y  # the kernels' gridDim.y
    return dtypes_ok and pairs_ok and H % 8 == 0 and C % 8 == 0 and H_out % 8 == 0


def kernel_applies(x, ids, w_in, w_out) -> bool:
    """Whether a moe_mlp call of these static shapes and dtypes takes the fused decode kernels:
    they fit, and the groups are decode-sized."""
    T, K, L = x.shape[0], ids.shape[1], w_in.shape[-3]
    return _kernel_fits(x, ids, w_in, w_out) and gemm_primitives.use_decode_kernel(1, T * K, L)


def moe_mlp_decode(x, weights, ids, w_in, w_out, *, activation: str, layer=None, residual=None):
    """Binds the primitive (arguments checked by `layer.moe_mlp`); with `layer`, w_in and w_out
    are stacks over the model's layers; with `residual` ([T, H'] in x's dtype) the result is
    residual + the weighted sum."""
    args = [x, weights.astype(jnp.float32), ids.astype(jnp.int32), w_in, w_out]
    if layer is not None:  # the stacked form: one more operand
        args.append(jnp.asarray(layer, jnp.int32).reshape(()))
    if residual is not None:
        args.append(residual)
    return moe_mlp_decode_p.bind(*bind_operands(*args, batched=False), activation=activation,
                                 with_residual=residual is not None)


def _layer_and_residual(rest, with_residual):
    """The optional operands after w_out: ([layer] or [], residual or None)."""
    return (rest[:-1], rest[-1]) if with_residual else (rest, None)


def _unfused(x, weights, ids, w_in, w_out, *rest, activation, with_residual):
    from . import layer as layer_module  # it binds this primitive: import it when first lowered

    layer, residual = _layer_and_residual(rest, with_residual)
    layer = layer[0] if layer else None
    w_in, w_out = ops.layer_weights(w_in, layer), ops.layer_weights(w_out, layer)
    out = layer_module.unfused_routed_experts(x, weights, ids, w_in, w_out, activation)
    return out if residual is None else out + residual


def _abstract(x, weights, ids, w_in, w_out, *rest, activation, with_residual):
    # Like the token operands (the bind made every operand vary along the same manual axes).
    return _compat.shaped_like((x, weights, ids), (x.shape[0], w_out.shape[-1]), x.dtype)


def _lower_cuda(ctx, x, weights, ids, w_in, w_out, *rest, activation, with_residual):
    x_aval, _, ids_aval, w_in_aval, w_out_aval = ctx.avals_in[:5]
    if not _kernel_fits(x_aval, ids_aval, w_in_aval, w_out_aval):  # e.g. float32, called directly
        return _lower_unfused(ctx, x, weights, ids, w_in, w_out, *rest, activation=activation,
                              with_residual=with_residual)
    (T, H), K, (L, _, C), (F, H_out) = x_aval.shape, ids_aval.shape[1], w_in_aval.shape[-3:], w_out_aval.shape[-2:]
    code = ACTIVATION_CODES[activation]
    nbytes = _native.workspace_bytes("cuda", "moe_mlp_decode", T, K, L, H, F, C, H_out, code)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, core.ShapedArray((max(int(nbytes), 1),), jnp.uint8)])
    layer, _ = _layer_and_residual(rest, with_residual)
    name = "moe_mlp_decode" + ("_stacked" if layer else "") + ("_residual" if with_residual else "")
    call = jax.ffi.ffi_lowering(_native.target(name))
    return call(ctx, x, weights, ids, w_in, w_out, *rest, activation=np.int64(code))[:-1]


def _batch(args, dims, *, activation, with_residual):
    """A vmapped call runs the unfused composition (whose ops batch into single launches)."""
    unfused = functools.partial(_unfused, activation=activation, with_residual=with_residual)
    return jax.vmap(unfused, in_axes=dims)(*args), 0


def _jvp(primals, tangents, *, activation, with_residual):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    unfused = functools.partial(_unfused, activation=activation, with_residual=with_residual)
    return jax.jvp(unfused, tuple(primals), tangents)


_lower_unfused = mlir.lower_fun(_unfused, multiple_results=False)

moe_mlp_decode_p.def_impl(jax.jit(moe_mlp_decode_p.bind, static_argnames=("activation", "with_residual")))
moe_mlp_decode_p.def_abstract_eval(_abstract)
mlir.register_lowering(moe_mlp_decode_p, _lower_unfused)
batching.primitive_batchers[moe_mlp_decode_p] = _batch
ad.primitive_jvps[moe_mlp_decode_p] = _jvp
if _native.has_target("cuda", "moe_mlp_decode"):
    mlir.register_lowering(moe_mlp_decode_p, _lower_cuda, platform="cuda")
