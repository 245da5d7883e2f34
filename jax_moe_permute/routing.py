"""Top-k routing of MoE router logits: softmax (Mixtral, Qwen3-MoE) and sigmoid with a selection
bias and expert groups (DeepSeek-V3), plus the router's auxiliary losses.

All router math runs in float32 whatever the logits' dtype: top-k choices and the balancing
losses are sensitive to rounding, and the router is a negligible share of the layer's work.

The choice and gates run as one kernel launch where it is built (CPU and CUDA, up to
router_kernel.MAX_EXPERTS experts; router_kernel.py), the same jnp math as `reference_route`
elsewhere. `route_tokens` takes the tokens and the router weight instead of the logits, and for
a decode step's one token (sm_90, 64 to 256 experts) runs the product too in that launch. The
auxiliary values are jnp from the logits and ids, so XLA drops them from programs that do not
use them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from . import reference, router_kernel
from .explicit_sharding import replicated
from .ops import check_layer, layer_weights, static_int
from .token_rounding import TokenRounding, check_token_rounding, round_routing

SCORINGS = ("softmax", "sigmoid")

# route takes the fused router kernel for T <= FUSED_ROUTE_MAX_TOKENS tokens (None: any T) and
# E <= router_kernel.MAX_EXPERTS experts, the jnp math otherwise; read at trace time.
FUSED_ROUTE_MAX_TOKENS: Optional[int] = None


class RouterAux(NamedTuple):
    """Router statistics (a pytree of float32 scalars and an int32 vector).

    load_balance_loss: E * sum_e f_e * P_e, with f_e the fraction of tokens that chose expert e
        among their K and P_e the mean routing probability of e (softmax probabilities, or the
        sigmoid scores normalised over the experts). It is K for a perfectly balanced router
        (1 for top-1: the Switch Transformer form; HF Mixtral's `load_balancing_loss_func`).
    router_z_loss: mean over tokens of logsumexp(logits)^2 (ST-MoE).
    tokens_per_expert: [E] int32 number of (token, slot) entries routed to each expert.
    """

    load_balance_loss: jax.Array
    router_z_loss: jax.Array
    tokens_per_expert: jax.Array


class Routing(NamedTuple):
    """What `route` returns (a pytree).

    weights: [T, K] float32 gate of each chosen expert.
    ids: [T, K] int32 chosen experts, best first.
    aux: RouterAux.
    """

    weights: jax.Array
    ids: jax.Array
    aux: RouterAux


def check_routing_args(num_experts: int, top_k: int, scoring: str, num_groups, topk_groups) -> None:
    """The checks `route` makes on its static arguments (the modules make them at construction)."""
    num_experts = static_int(num_experts, "num_experts (logits.shape[1])", "route")
    top_k = static_int(top_k, "top_k", "route")
    if top_k > num_experts:
        raise ValueError(f"route: top_k ({top_k}) must be <= the number of experts ({num_experts})")
    if scoring not in SCORINGS:
        raise ValueError(f"route: scoring must be one of {SCORINGS}, got {scoring!r}")
    if (num_groups is None) != (topk_groups is None):
        raise ValueError("route: num_groups and topk_groups must be given together")
    if num_groups is not None:
        num_groups = static_int(num_groups, "num_groups", "route")
        topk_groups = static_int(topk_groups, "topk_groups", "route")
        if num_experts % num_groups:
            raise ValueError(f"route: num_groups ({num_groups}) must divide the number of experts ({num_experts})")
        if topk_groups > num_groups:
            raise ValueError(f"route: topk_groups ({topk_groups}) must be <= num_groups ({num_groups})")
        if top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(f"route: top_k ({top_k}) exceeds the experts of the topk_groups ({topk_groups}) "
                             f"best groups ({topk_groups * (num_experts // num_groups)})")


def _check_route_args(logits, top_k, scoring, bias, num_groups, topk_groups) -> None:
    if not hasattr(logits, "shape") or logits.ndim != 2:
        raise ValueError(f"route: logits must have shape [T, E], got {getattr(logits, 'shape', type(logits))}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"route: logits must have a float dtype, got {jnp.dtype(logits.dtype).name}")
    E = logits.shape[1]
    check_routing_args(E, top_k, scoring, num_groups, topk_groups)
    if bias is not None and (not hasattr(bias, "shape") or tuple(bias.shape) != (E,)):
        raise ValueError(f"route: bias must have shape [{E}] (the number of experts), "
                         f"got {getattr(bias, 'shape', type(bias))}")


def route(
    logits: jax.Array,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: Optional[jax.Array] = None,
    num_groups: Optional[int] = None,
    topk_groups: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    token_rounding: Optional[TokenRounding] = None,
) -> Routing:
    """Chooses each token's top_k experts from router logits and their gate weights.

    Args:
      logits: [T, E] router logits, any float dtype (computed on in float32).
      top_k: K, static, 1 <= K <= E.
      scoring: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3).
      renormalize: divide the K chosen scores by their sum (Mixtral always; Qwen3-MoE's
        `norm_topk_prob`; DeepSeek-V3's `norm_topk_prob`, with its +1e-20 for sigmoid).
      bias: optional [E] added to the scores for the choice only (DeepSeek-V3's
        `e_score_correction_bias`); the weights stay the unbiased scores.
      num_groups, topk_groups: optional, together: experts split into num_groups equal
        groups, a group scored by the sum of its two best biased scores; only the topk_groups
        best groups compete.
      routed_scaling_factor: the weights' final scale.
      token_rounding: optional `TokenRounding` (opt-in, for training at large T): each expert's
        entries rounded to a multiple of a GEMM tile by dropping its worst chosen tokens or
        adding its best unchosen ones (token_rounding.py). Ids and weights then have K + X
        columns (X extra slots; dropped and unused entries have id -1 and weight 0).

    Returns Routing(weights [T, K] float32, ids [T, K] int32, aux RouterAux).
    """
    _check_route_args(logits, top_k, scoring, bias, num_groups, topk_groups)
    check_token_rounding(token_rounding, top_k)
    T, E = logits.shape
    fused = (E <= router_kernel.MAX_EXPERTS
             and (FUSED_ROUTE_MAX_TOKENS is None or T <= FUSED_ROUTE_MAX_TOKENS))
    return _route(logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, routed_scaling_factor, fused,
                  token_rounding)


def reference_route(
    logits: jax.Array,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: Optional[jax.Array] = None,
    num_groups: Optional[int] = None,
    topk_groups: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
) -> Routing:
    """`route` in plain jnp (softmax / sigmoid, top_k, gates as separate XLA ops): what the router
    kernel must reproduce, and the path for more experts than it holds."""
    _check_route_args(logits, top_k, scoring, bias, num_groups, topk_groups)
    return _route(logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, routed_scaling_factor, False,
                  None)


def route_tokens(
    x: jax.Array,
    router: jax.Array,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: Optional[jax.Array] = None,
    num_groups: Optional[int] = None,
    topk_groups: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    token_rounding: Optional[TokenRounding] = None,
    layer=None,
) -> Routing:
    """`route(router_logits(x, router), top_k, ...)`: the router's product and the choice.

    For one bfloat16 or float16 token (a decode step) on sm_90, with E a multiple of 8 from 64 to
    256 and a router of at most 1 MiB, both run as one kernel launch (the product as an XLA dot
    would cost more than reading the router; router_kernel.py has the measured rule); otherwise
    exactly that composition. The logits are float32 sums of x's dtype products in either case
    (the product's summation order differs between the two, so logits agree to float32
    rounding); the ids and weights are `route`'s of those logits. Differentiable in x and router as the composition is.

    Args:
      x: [T, H] tokens, float.
      router: [H, E] router weight (used in x's dtype, as router_logits does).
      top_k and the keyword arguments: as `route`.
      layer: optional int32 scalar (e.g. a `lax.scan`'s layer counter): router [NL, H, E] and
        bias [NL, E] are then stacks over a model's layers and the call uses router[layer],
        bias[layer]; the one-launch kernel reads that layer on the device (see `moe_mlp`).

    Returns Routing(weights [T, K] float32, ids [T, K] int32, aux RouterAux).
    """
    if not hasattr(x, "shape") or x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"route_tokens: x must be a float array of shape [T, H], got "
                         f"{getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}")
    stacked = () if layer is None else ("NL",)
    if layer is not None:
        layer = check_layer(layer, (("router", router),) + ((("bias", bias),) if bias is not None else ()),
                            "route_tokens")
    if (not hasattr(router, "shape") or router.ndim != 2 + len(stacked) or router.shape[-2] != x.shape[1]
            or not jnp.issubdtype(router.dtype, jnp.floating)):
        raise ValueError(f"route_tokens: router must be a float array of shape {[*stacked, x.shape[1], 'E']}, got "
                         f"{getattr(router, 'shape', type(router))} {getattr(router, 'dtype', '')}")
    E = router.shape[-1]
    check_routing_args(E, top_k, scoring, num_groups, topk_groups)
    check_token_rounding(token_rounding, top_k, "route_tokens")
    if bias is not None and (not hasattr(bias, "shape") or tuple(bias.shape) != (*router.shape[:-2], E)):
        raise ValueError(f"route_tokens: bias must have shape {[*router.shape[:-2], E]} (the number of experts), "
                         f"got {getattr(bias, 'shape', type(bias))}")
    if not router_kernel.hidden_applies(x.shape, x.dtype, E):
        if layer is not None:  # the layer's router in a jnp product: no custom call to slice for
            router, bias = layer_weights(router, layer), layer_weights(bias, layer)
        return route(router_kernel.router_logits(x, router), top_k, scoring=scoring, renormalize=renormalize,
                     bias=bias, num_groups=num_groups, topk_groups=topk_groups,
                     routed_scaling_factor=routed_scaling_factor, token_rounding=token_rounding)
    logits, weights, ids = router_kernel.router_hidden(
        x, router, bias, top_k, scoring=scoring, renormalize=renormalize, num_groups=num_groups,
        topk_groups=topk_groups, routed_scaling_factor=routed_scaling_factor, layer=layer)
    return _routing(logits, weights, ids, scoring, renormalize, routed_scaling_factor, token_rounding)


def _route(logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, routed_scaling_factor,
           fused: bool, token_rounding) -> Routing:
    kw = dict(scoring=scoring, renormalize=renormalize, num_groups=num_groups, topk_groups=topk_groups,
              routed_scaling_factor=routed_scaling_factor)
    if fused:
        weights, ids = router_kernel.router(logits, bias, top_k, **kw)
    else:
        weights, ids = reference.route_topk(logits, top_k, bias=bias, **kw)
    return _routing(logits, weights, ids, scoring, renormalize, routed_scaling_factor, token_rounding)


def _routing(logits, weights, ids, scoring, renormalize, routed_scaling_factor, token_rounding) -> Routing:
    """The Routing of a top-k choice, token-rounded when asked."""
    if token_rounding is not None:
        weights, ids = round_routing(logits, weights, ids, token_rounding, scoring=scoring, renormalize=renormalize,
                                     routed_scaling_factor=routed_scaling_factor)
    return Routing(weights, ids, _aux(logits, ids, scoring))


def _aux(logits, ids, scoring: str) -> RouterAux:
    """The aux values, from the logits and ids (-1: no entry): dead code unless a caller uses them."""
    T, E = logits.shape
    logits = logits.astype(jnp.float32)
    scores = reference.router_scores(logits, scoring)
    probs = scores if scoring == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    counts = jnp.zeros(E, jnp.int32).at[replicated(jnp.where(ids < 0, E, ids)).reshape(-1)].add(1, mode="drop")
    tokens = max(T, 1)  # T = 0: zero losses rather than 0/0
    fraction = jax.lax.stop_gradient(counts.astype(jnp.float32)) / tokens
    mean_prob = jnp.sum(probs, axis=0) / tokens
    load_balance = E * jnp.sum(fraction * mean_prob)
    z_loss = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))) / tokens
    return RouterAux(load_balance, z_loss, counts)


def balance_bias(bias: jax.Array, tokens_per_expert: jax.Array, rate: float = 1e-3) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: after a step, raise the selection bias of
    experts that got fewer than the mean number of entries and lower it for those that got more,
    by `rate` (its gamma). bias [E] float, tokens_per_expert [E] (e.g. RouterAux's, summed over
    layers' steps as you like); returns the new bias, same dtype. Not differentiated."""
    counts = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    step = jnp.sign(jnp.mean(counts) - counts)
    return (bias.astype(jnp.float32) + rate * step).astype(bias.dtype)
