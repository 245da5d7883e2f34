"""The router primitive: route's choice and gates (softmax or sigmoid, selection bias, group-limited
choice, top-k, renormalisation, scale) as one kernel launch, with its abstract evaluation, lowerings,
batching and autodiff rules.

  moe_router  (logits [T, E], bias [1 or T, E]) -> (weights [T, K] float32, ids [T, K] int32)

It computes `reference.route_topk` (the jnp math it replaces): ids are the top-k of the choice
with top_k's tie order, weights the scores of those ids. Routing is row-wise, so T is the batch
axis here: vmap folds its axis into T and sharded jit partitions along T. On CPU and CUDA it is
our kernel (E <= MAX_EXPERTS); elsewhere the jnp math. Its JVP is the jnp gates' tangent with the
ids held fixed: gradients reach the router through the weights, the choice is not differentiated.
The absent bias is a [1, 1] placeholder flagged by has_bias.

  moe_router_hidden  (x [T, H], router [H, E] in x's dtype, bias) -> (logits [T, E] float32, weights, ids)

is the router's product and that choice in one: (router_logits(x, router), *moe_router(logits)).
For a few bf16 / f16 tokens on sm_90 it is one launch (cpp/router.cu, router_hidden: a
thread-block cluster splits H and adds its partial logits in distributed shared memory), where the
product as an XLA dot costs more than the weight read; elsewhere that composition. Its ids and
weights are moe_router's of the logits it returns (the same per-token routine), bitwise.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from . import _native, gemm_primitives, reference
from ._compat import lowers_for_many_devices, require_devices_at_lowering, shaped_like
from .batch_axis import bind_operands
from .explicit_sharding import on_explicit_mesh
from .lowering import _batch_partitioned
from .ops import layer_weights

# The kernels hold a token's E scores in registers / on the stack (kRouterMaxExperts in
# cpp/kernel_args.h); route keeps the jnp math for more experts.
MAX_EXPERTS = 1024
KERNEL_LOGIT_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))
_SCORING_CODES = {"softmax": 0, "sigmoid": 1}

router_p = Primitive("moe_router")
router_p.multiple_results = True
_PARAMS = ("top_k", "scoring", "renormalize", "num_groups", "topk_groups", "scale", "has_bias")
router_p.def_impl(jax.jit(router_p.bind, static_argnames=_PARAMS))


def router(logits, bias, top_k: int, *, scoring: str, renormalize: bool, num_groups, topk_groups,
           routed_scaling_factor: float):
    """(weights [T, K] float32, ids [T, K] int32) of logits [T, E] (any float dtype) and bias
    None or [E], arguments as `route` (checked there)."""
    E = logits.shape[1]
    if jnp.dtype(logits.dtype) not in KERNEL_LOGIT_DTYPES:
        logits = logits.astype(jnp.float32)
    has_bias = bias is not None
    bias = (jax.lax.stop_gradient(bias).astype(jnp.float32).reshape(1, E) if has_bias
            else jnp.zeros((1, 1), jnp.float32))
    weights, ids = router_p.bind(*bind_operands(logits, bias), top_k=int(top_k), scoring=scoring,
                                 renormalize=bool(renormalize), num_groups=int(num_groups or 0),
                                 topk_groups=int(topk_groups or 0), scale=float(routed_scaling_factor),
                                 has_bias=has_bias)
    return weights, ids


# ---- abstract evaluation ----------------------------------------------------------------------

def _abstract(logits, bias, *, top_k, scoring, renormalize, num_groups, topk_groups, scale, has_bias):
    T, E = logits.shape
    if has_bias and (bias.shape[1] != E or bias.shape[0] not in (1, T)):
        raise ValueError(f"moe_router: bias must have shape [1 or {T}, {E}], got {tuple(bias.shape)}")
    avals = (logits, bias)
    return [shaped_like(avals, (T, top_k), jnp.float32), shaped_like(avals, (T, top_k), jnp.int32)]


# ---- lowering ---------------------------------------------------------------------------------

def _reference(logits, bias, *, top_k, scoring, renormalize, num_groups, topk_groups, scale, has_bias):
    return list(reference.route_topk(logits, top_k, scoring=scoring, renormalize=renormalize,
                                     bias=bias if has_bias else None, num_groups=num_groups or None,
                                     topk_groups=topk_groups or None, routed_scaling_factor=scale))


def _kernel_rule(ctx, logits, bias, *, top_k, scoring, renormalize, num_groups, topk_groups, scale, has_bias):
    out_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out]

    def call(z, b):
        T = z.shape[0]  # the local extent when the call is partitioned
        types = [jax.ShapeDtypeStruct((T,) + t.shape[1:], t.dtype) for t in out_types]
        return tuple(jax.ffi.ffi_call(_native.target("router"), types)(
            z, b, top_k=np.int64(top_k), scoring=np.int64(_SCORING_CODES[scoring]),
            renormalize=np.int64(renormalize), num_groups=np.int64(num_groups), topk_groups=np.int64(topk_groups),
            has_bias=np.int64(has_bias), scale=np.float32(scale)))

    fn = call
    if lowers_for_many_devices(ctx):  # split along T, the bias replicated unless per token
        fn = _batch_partitioned(call, ctx.avals_in, ctx.avals_out)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, logits, bias)


# ---- batching: a vmapped axis folds into T ----------------------------------------------------

def _batch(args, dims, **params):
    logits, bias = args
    logits_dim, bias_dim = dims
    if not params["has_bias"]:  # the placeholder: any example's will do
        bias, bias_dim = (bias if bias_dim is None else jnp.take(bias, 0, axis=bias_dim)), None
        if logits_dim is None:
            return router_p.bind(logits, bias, **params), [None, None]
    V = logits.shape[logits_dim] if logits_dim is not None else bias.shape[bias_dim]
    T, E = logits.shape[1:] if logits_dim is not None else logits.shape
    logits = (jnp.moveaxis(logits, logits_dim, 0) if logits_dim is not None
              else jnp.broadcast_to(logits, (V, T, E))).reshape(V * T, E)
    if bias_dim is not None:  # one bias row per (example, token)
        bias = jnp.moveaxis(bias, bias_dim, 0)
        bias = jnp.broadcast_to(bias, (V, T, E)).reshape(V * T, E)
    elif bias.shape[0] != 1:  # per token, shared by the examples
        bias = jnp.broadcast_to(bias[None], (V, T, E)).reshape(V * T, E)
    weights, ids = router_p.bind(logits, bias, **params)
    K = params["top_k"]
    return [weights.reshape(V, T, K), ids.reshape(V, T, K)], [0, 0]


# ---- autodiff: the jnp gates' tangent, ids held fixed -----------------------------------------

def _jvp(primals, tangents, *, top_k, scoring, renormalize, num_groups, topk_groups, scale, has_bias):
    logits, bias = primals
    weights, ids = router_p.bind(logits, bias, top_k=top_k, scoring=scoring, renormalize=renormalize,
                                 num_groups=num_groups, topk_groups=topk_groups, scale=scale, has_bias=has_bias)
    d_logits = tangents[0]
    ids_tangent = ad.Zero(core.ShapedArray(ids.shape, jax.dtypes.float0))
    if type(d_logits) is ad.Zero:  # the bias steers the choice only: no tangent through it
        return [weights, ids], [ad.Zero(core.ShapedArray(weights.shape, weights.dtype)), ids_tangent]
    gates = lambda z: reference.route_weights(z, ids, scoring=scoring, renormalize=renormalize,
                                              routed_scaling_factor=scale)
    _, d_weights = jax.jvp(gates, (logits,), (d_logits,))
    return [weights, ids], [d_weights, ids_tangent]


router_p.def_abstract_eval(_abstract)
mlir.register_lowering(router_p, mlir.lower_fun(_reference, multiple_results=True))
for _platform in _native.platforms():
    if _native.has_target(_platform, "router"):
        mlir.register_lowering(router_p, _kernel_rule, platform=_platform)
batching.primitive_batchers[router_p] = _batch
ad.primitive_jvps[router_p] = _jvp
require_devices_at_lowering(router_p)


# ---- the router's product ---------------------------------------------------------------------

def router_logits(x, router):
    """[T, H] @ [H, E] -> float32 logits, for the float32 router math that follows.

    The product runs in x's dtype and accumulates in float32: a bf16 layer gets a bf16 tensor-core
    GEMM (as Mixtral's and Qwen3's bf16 router Linear); a float32 product at full precision costs
    4-10% of a bf16 layer's time on the DeepSeek-V3 and Qwen3 shapes. A float32 layer keeps full
    float32 precision."""
    full = jnp.dtype(x.dtype) == jnp.float32
    precision = jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT
    out_sharding = None
    aval = jax.typeof(x)
    if on_explicit_mesh(aval):  # sharded tokens stay sharded; a sharded H is summed over
        out_sharding = aval.sharding.update(spec=PartitionSpec(aval.sharding.spec[0], None))
    return jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32, precision=precision,
                   out_sharding=out_sharding)


# ---- moe_router_hidden: the product and the choice in one launch ------------------------------

# route_tokens binds moe_router_hidden for T <= HIDDEN_MAX_TOKENS (the kernel's token groups of
# up to 8 share one read of the router; more tokens are a GEMM's work); read at trace time.
HIDDEN_MAX_TOKENS = 8
# Where the kernel runs when a call is lowered on sm_90, elsewhere the composition: measured faster
# on the H200 for one token with 64 or more experts and a router of at most 1 MiB (Qwen3, gpt-oss,
# Qwen3-235B: 0.65-0.75 of the composition's time); slower with 2-8 tokens (1.2-2.5x), with 8-32
# experts (a small router's product is a short XLA reduction) and with the large routers that one
# cluster reads slowly (DeepSeek-V3's 3.5 MiB: 1.28x). benchmarks/micro/router_hidden_ab.py, docs/layer.md.
HIDDEN_KERNEL_MAX_TOKENS = 1
HIDDEN_KERNEL_MIN_EXPERTS = 64
HIDDEN_MAX_ROUTER_BYTES = 1 << 20
_HIDDEN_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16)))


@contextlib.contextmanager
def hidden_kernel_wherever_it_fits():
    """Within it, moe_router_hidden lowers to the kernel wherever the kernel fits (any T up to
    HIDDEN_MAX_TOKENS, E from 8, any router size), past the speed rule above: to test or measure
    the kernel. Only calls lowered inside take it (jit caches what was lowered before)."""
    global HIDDEN_KERNEL_MAX_TOKENS, HIDDEN_KERNEL_MIN_EXPERTS, HIDDEN_MAX_ROUTER_BYTES
    saved = HIDDEN_KERNEL_MAX_TOKENS, HIDDEN_KERNEL_MIN_EXPERTS, HIDDEN_MAX_ROUTER_BYTES
    HIDDEN_KERNEL_MAX_TOKENS, HIDDEN_KERNEL_MIN_EXPERTS, HIDDEN_MAX_ROUTER_BYTES = HIDDEN_MAX_TOKENS, 8, float("inf")
    try:
        yield
    finally:
        HIDDEN_KERNEL_MAX_TOKENS, HIDDEN_KERNEL_MIN_EXPERTS, HIDDEN_MAX_ROUTER_BYTES = saved

router_hidden_p = Primitive("moe_router_hidden")
router_hidden_p.multiple_results = True
router_hidden_p.def_impl(jax.jit(router_hidden_p.bind, static_argnames=_PARAMS))


def hidden_applies(x_shape, x_dtype, num_experts: int) -> bool:
    """Whether route_tokens binds moe_router_hidden for these static shapes: bf16 / f16 tokens,
    at most HIDDEN_MAX_TOKENS of them, E a multiple of 8 up to 256 (the kernel's; its lowering
    takes the composition on other platforms)."""
    T, H = x_shape
    return (jnp.dtype(x_dtype) in _HIDDEN_DTYPES and 1 <= T <= HIDDEN_MAX_TOKENS and H >= 1
            and num_experts % 8 == 0 and 8 <= num_experts <= 256)


def router_hidden(x, router, bias, top_k: int, *, scoring: str, renormalize: bool, num_groups, topk_groups,
                  routed_scaling_factor: float, layer=None):
    """(logits [T, E] float32, weights [T, K] float32, ids [T, K] int32) of x [T, H] and
    router [H, E] (cast to x's dtype), bias None or [E]; arguments checked by route_tokens. With
    `layer` (an int32 scalar) router [NL, H, E] and bias [NL, E] are stacks over the layers."""
    E = router.shape[-1]
    has_bias = bias is not None
    params = dict(top_k=int(top_k), scoring=scoring, renormalize=bool(renormalize), num_groups=int(num_groups or 0),
                  topk_groups=int(topk_groups or 0), scale=float(routed_scaling_factor), has_bias=has_bias)
    if layer is not None:
        bias = (jax.lax.stop_gradient(bias).astype(jnp.float32) if has_bias
                else jnp.zeros((1, 1), jnp.float32))
        layer = jnp.asarray(layer, jnp.int32).reshape(())
        return router_hidden_stacked_p.bind(*bind_operands(x, router.astype(x.dtype), bias, layer, batched=False),
                                            **params)
    bias = (jax.lax.stop_gradient(bias).astype(jnp.float32).reshape(1, E) if has_bias
            else jnp.zeros((1, 1), jnp.float32))
    return router_hidden_p.bind(*bind_operands(x, router.astype(x.dtype), bias, batched=False), **params)


def _hidden_abstract(x, router, bias, **params):
    (T, H), E = x.shape, router.shape[1]
    if router.shape[0] != H:
        raise ValueError(f"moe_router_hidden: router must have shape [{H}, E], got {tuple(router.shape)}")
    if params["has_bias"] and (bias.shape[1] != E or bias.shape[0] not in (1, T)):
        raise ValueError(f"moe_router_hidden: bias must have shape [1 or {T}, {E}], got {tuple(bias.shape)}")
    avals, K = (x, router, bias), params["top_k"]
    return [shaped_like(avals, (T, E), jnp.float32), shaped_like(avals, (T, K), jnp.float32),
            shaped_like(avals, (T, K), jnp.int32)]


def _hidden_composition(x, router, bias, **params):
    logits = router_logits(x, router)
    return [logits, *router_p.bind(logits, bias, **params)]


def _hidden_kernel_fits(x, router, num_groups) -> bool:
    (T, H), E = x.shape, router.shape[1]
    return (gemm_primitives.gpu_is_sm90() and _native.has_target("cuda", "router_hidden")
            and jnp.dtype(x.dtype) in _HIDDEN_DTYPES and router.dtype == x.dtype
            and T <= HIDDEN_KERNEL_MAX_TOKENS and E >= HIDDEN_KERNEL_MIN_EXPERTS
            and H * E * jnp.dtype(x.dtype).itemsize <= HIDDEN_MAX_ROUTER_BYTES
            and bool(_native.kernel_fits("cuda", "router_hidden", T, H, E, num_groups)))


def _hidden_cuda_rule(ctx, x, router, bias, **params):
    x_aval, router_aval, _ = ctx.avals_in
    if lowers_for_many_devices(ctx) or not _hidden_kernel_fits(x_aval, router_aval, params["num_groups"]):
        return _lower_hidden_composition(ctx, x, router, bias, **params)
    return _hidden_ffi_call("router_hidden", ctx, (x, router, bias), params)


def _hidden_ffi_call(target: str, ctx, operands, params):
    """The router_hidden kernel's custom call (one router or the stacked form)."""
    return jax.ffi.ffi_lowering(_native.target(target))(
        ctx, *operands, top_k=np.int64(params["top_k"]), scoring=np.int64(_SCORING_CODES[params["scoring"]]),
        renormalize=np.int64(params["renormalize"]), num_groups=np.int64(params["num_groups"]),
        topk_groups=np.int64(params["topk_groups"]), has_bias=np.int64(params["has_bias"]),
        scale=np.float32(params["scale"]))


def _hidden_batch(args, dims, **params):
    """A vmapped axis of x folds into T; a batched router or bias runs the composition."""
    x, router, bias = args
    x_dim, router_dim, bias_dim = dims
    if router_dim is not None or (params["has_bias"] and (bias_dim is not None or bias.shape[0] != 1)):
        return jax.vmap(lambda *a: _hidden_composition(*a, **params), in_axes=dims)(*args), [0, 0, 0]
    if bias_dim is not None:  # the placeholder
        bias = jnp.take(bias, 0, axis=bias_dim)
    x = jnp.moveaxis(x, x_dim, 0)
    V, T = x.shape[:2]
    outs = router_hidden_p.bind(x.reshape(V * T, x.shape[2]), router, bias, **params)
    return [o.reshape(V, T, o.shape[1]) for o in outs], [0, 0, 0]


def _hidden_jvp(primals, tangents, **params):
    x, router, bias = primals
    outs = router_hidden_p.bind(x, router, bias, **params)
    return outs, _hidden_tangents(x, router, outs, *tangents[:2], **params)


def _hidden_tangents(x, router, outs, d_x, d_router, **params):
    """The product's tangent, then the gates' at the logits with the ids held fixed."""
    logits, weights, ids = outs
    parts = []
    if type(d_x) is not ad.Zero:
        parts.append(router_logits(d_x, router))
    if type(d_router) is not ad.Zero:
        parts.append(router_logits(x, d_router))
    ids_tangent = ad.Zero(core.ShapedArray(ids.shape, jax.dtypes.float0))
    if not parts:
        zero = lambda a: ad.Zero(core.ShapedArray(a.shape, a.dtype))
        return [zero(logits), zero(weights), ids_tangent]
    d_logits = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    gates = lambda z: reference.route_weights(z, ids, scoring=params["scoring"], renormalize=params["renormalize"],
                                              routed_scaling_factor=params["scale"])
    _, d_weights = jax.jvp(gates, (logits,), (d_logits,))
    return [d_logits, d_weights, ids_tangent]


_lower_hidden_composition = mlir.lower_fun(_hidden_composition, multiple_results=True)

router_hidden_p.def_abstract_eval(_hidden_abstract)
mlir.register_lowering(router_hidden_p, _lower_hidden_composition)
if _native.has_target("cuda", "router_hidden"):
    mlir.register_lowering(router_hidden_p, _hidden_cuda_rule, platform="cuda")
batching.primitive_batchers[router_hidden_p] = _hidden_batch
ad.primitive_jvps[router_hidden_p] = _hidden_jvp
require_devices_at_lowering(router_hidden_p)  # its composition holds moe_router


# ---- moe_router_hidden_stacked: the same on routers stacked over a model's layers -------------
# (x [T, H], router [NL, H, E], bias [NL, E] or a placeholder, layer [] int32): the kernel reads
# the layer on the device, so a `lax.scan` over layers passes it the whole stack instead of a
# dynamic slice, whose offset XLA copies to the host and waits for at every layer.

router_hidden_stacked_p = Primitive("moe_router_hidden_stacked")
router_hidden_stacked_p.multiple_results = True
router_hidden_stacked_p.def_impl(jax.jit(router_hidden_stacked_p.bind, static_argnames=_PARAMS))


def _layer_router(router, bias, layer, has_bias):
    """The layer's router [H, E] and its bias as moe_router_hidden takes it ([1, E] or the placeholder)."""
    bias = jax.lax.dynamic_slice_in_dim(bias, layer, 1, 0) if has_bias else bias
    return layer_weights(router, layer), bias


def _stacked_abstract(x, router, bias, layer, **params):
    (T, H), (NL, H_router, E) = x.shape, router.shape
    if H_router != H:
        raise ValueError(f"moe_router_hidden_stacked: router must have shape [NL, {H}, E], got {tuple(router.shape)}")
    if params["has_bias"] and tuple(bias.shape) != (NL, E):
        raise ValueError(f"moe_router_hidden_stacked: bias must have shape [{NL}, {E}], got {tuple(bias.shape)}")
    avals, K = (x,), params["top_k"]  # like the tokens (the bind made the operands vary alike)
    return [shaped_like(avals, (T, E), jnp.float32), shaped_like(avals, (T, K), jnp.float32),
            shaped_like(avals, (T, K), jnp.int32)]


def _stacked_composition(x, router, bias, layer, **params):
    return _hidden_composition(x, *_layer_router(router, bias, layer, params["has_bias"]), **params)


def _stacked_cuda_rule(ctx, x, router, bias, layer, **params):
    x_aval, router_aval = ctx.avals_in[:2]
    layer_aval = core.ShapedArray(router_aval.shape[1:], router_aval.dtype)
    if lowers_for_many_devices(ctx) or not _hidden_kernel_fits(x_aval, layer_aval, params["num_groups"]):
        return _lower_stacked_composition(ctx, x, router, bias, layer, **params)
    return _hidden_ffi_call("router_hidden_stacked", ctx, (x, router, bias, layer), params)


def _stacked_batch(args, dims, **params):
    return jax.vmap(lambda *a: _stacked_composition(*a, **params), in_axes=dims)(*args), [0, 0, 0]


def _stacked_jvp(primals, tangents, **params):
    """moe_router_hidden's rule on the layer's router (the stacked kernel for the primal)."""
    x, router, bias, layer = primals
    d_x, d_router = tangents[:2]
    if type(d_router) is not ad.Zero:
        d_router = layer_weights(d_router, layer)
    else:
        d_router = ad.Zero(core.ShapedArray(router.shape[1:], router.dtype))
    outs = router_hidden_stacked_p.bind(x, router, bias, layer, **params)
    return outs, _hidden_tangents(x, layer_weights(router, layer), outs, d_x, d_router, **params)


_lower_stacked_composition = mlir.lower_fun(_stacked_composition, multiple_results=True)

router_hidden_stacked_p.def_abstract_eval(_stacked_abstract)
mlir.register_lowering(router_hidden_stacked_p, _lower_stacked_composition)
if _native.has_target("cuda", "router_hidden_stacked"):
    mlir.register_lowering(router_hidden_stacked_p, _stacked_cuda_rule, platform="cuda")
batching.primitive_batchers[router_hidden_stacked_p] = _stacked_batch
ad.primitive_jvps[router_hidden_stacked_p] = _stacked_jvp
require_devices_at_lowering(router_hidden_stacked_p)  # its composition holds moe_router
