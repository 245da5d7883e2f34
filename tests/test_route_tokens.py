"""route_tokens (the router's product and the choice; one launch at decode sizes on sm_90) against
route(router_logits(x, router)): the logits to float32 rounding, the ids and weights those of
route on the logits it computed, bitwise; gradients and vmap as the composition's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute import _native, gemm_primitives, router_kernel, routing
from conftest import random_float

STATIC = ("scoring", "renormalize", "num_groups", "topk_groups", "routed_scaling_factor")
route_tokens = jax.jit(jmp.route_tokens, static_argnums=2, static_argnames=STATIC)
route = jax.jit(jmp.route, static_argnums=1, static_argnames=STATIC)
DEEPSEEK = dict(scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5)


# The lowering's speed rule as router_kernel sets it (the fixture below lifts it for each test).
SPEED_RULE = {name: getattr(router_kernel, name)
              for name in ("HIDDEN_KERNEL_MAX_TOKENS", "HIDDEN_KERNEL_MIN_EXPERTS", "HIDDEN_MAX_ROUTER_BYTES")}


@pytest.fixture(autouse=True)
def kernel_wherever_it_fits():
    """The kernel on every case that fits it (every T up to 8, E from 8), past the lowering's speed
    rule (test_speed_rule checks that rule)."""
    with router_kernel.hidden_kernel_wherever_it_fits():
        yield


@jax.jit
def composition_logits(x, router):
    return router_kernel.router_logits(x, router)


def hidden(x, router, K, bias=None, **kw):
    """The primitive's (logits, weights, ids), as route_tokens binds it."""
    kw = dict(dict(scoring="softmax", renormalize=True, num_groups=None, topk_groups=None,
                   routed_scaling_factor=1.0), **kw)
    return jax.jit(lambda x, r, b: router_kernel.router_hidden(x, r, b, K, **kw))(x, router, bias)


def fused_here(x, router) -> bool:
    """Whether the primitive runs our kernel on this backend (else the composition)."""
    hlo = jax.jit(lambda x, r: router_kernel.router_hidden(x, r, None, 1, scoring="softmax", renormalize=True,
                                                           num_groups=None, topk_groups=None,
                                                           routed_scaling_factor=1.0)[0]).lower(x, router).as_text()
    return _native.target("router_hidden") in hlo


def check(T, H, E, K, dtype=jnp.bfloat16, with_bias=False, router=None, **kw):
    x = random_float((T, H), dtype)
    router = random_float((H, E), dtype, H ** -0.5) if router is None else router
    bias = random_float((E,), jnp.float32, 0.3) if with_bias else None
    ours = route_tokens(x, router, K, bias=bias, **kw)
    if not router_kernel.hidden_applies(x.shape, x.dtype, E):  # the composition itself
        want = route(composition_logits(x, router), K, bias=bias, **kw)
        np.testing.assert_array_equal(np.asarray(ours.ids), np.asarray(want.ids))
        np.testing.assert_array_equal(np.asarray(ours.weights), np.asarray(want.weights))
        return x, router, None
    logits, weights, ids = hidden(x, router, K, bias, **kw)
    exact = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(router, np.float64))
    np.testing.assert_allclose(np.asarray(logits), exact, rtol=0, atol=float(2e-6 * scale.max() + 1e-30))
    if not fused_here(x, router):  # the composition: its logits exactly
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(composition_logits(x, router)))
    want = route(logits, K, bias=bias, **kw)  # route on the logits it computed: the same per-token routine
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want.ids))
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(want.weights))
    np.testing.assert_array_equal(np.asarray(ours.ids), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(ours.weights), np.asarray(weights))
    np.testing.assert_array_equal(np.asarray(ours.aux.tokens_per_expert), np.asarray(want.aux.tokens_per_expert))
    return x, router, logits


@pytest.mark.parametrize("T,H,E,K", [(1, 2048, 128, 8), (2, 512, 64, 4), (3, 1000, 24, 3), (5, 64, 8, 2),
                                     (8, 4096, 8, 2), (7, 1, 16, 4), (4, 7, 8, 8), (1, 9, 8, 1), (6, 130, 256, 8)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax(T, H, E, K, dtype, renormalize):
    check(T, H, E, K, dtype, renormalize=renormalize)


@pytest.mark.parametrize("T,H,E,K,groups", [(1, 7168, 256, 8, (8, 4)), (4, 640, 64, 6, (8, 3)), (8, 96, 32, 4, None)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sigmoid_groups_bias(T, H, E, K, groups, with_bias):
    kw = dict(scoring="sigmoid", routed_scaling_factor=2.5)
    if groups:
        kw.update(num_groups=groups[0], topk_groups=groups[1])
    check(T, H, E, K, with_bias=with_bias, **kw)


@pytest.mark.parametrize("T,H,E,dtype", [(9, 64, 16, jnp.bfloat16), (2, 64, 12, jnp.bfloat16),
                                         (2, 64, 16, jnp.float32), (3, 64, 264, jnp.float16), (0, 64, 16, jnp.bfloat16)])
def test_composition_outside_the_kernel(T, H, E, dtype):
    """More tokens, E not a multiple of 8 or above 256, float32, no tokens: route(router_logits)."""
    assert not router_kernel.hidden_applies((T, H), dtype, E)
    check(T, H, E, min(4, E), dtype)


def test_ties_fall_to_the_lower_expert():
    """Equal router columns give bitwise equal logits (every column is summed in the same order),
    and route's tie order."""
    H, E = 512, 32
    router = random_float((H, E), jnp.bfloat16, H ** -0.5)
    router = router.at[:, 9].set(router[:, 3]).at[:, 20].set(router[:, 3])
    _, _, logits = check(4, H, E, 6, router=router)
    logits = np.asarray(logits)
    np.testing.assert_array_equal(logits[:, 9], logits[:, 3])
    np.testing.assert_array_equal(logits[:, 20], logits[:, 3])


def test_gradients_match_the_composition():
    T, H, E, K = 3, 256, 32, 4
    x, router = random_float((T, H), jnp.bfloat16), random_float((H, E), jnp.bfloat16, H ** -0.5)
    c = random_float((T, K), jnp.float32)
    ours = jax.jit(jax.grad(lambda x, r: jnp.sum(jmp.route_tokens(x, r, K).weights * c), (0, 1)))(x, router)
    ids = route_tokens(x, router, K).ids
    want_ids = route(composition_logits(x, router), K).ids
    theirs = jax.jit(jax.grad(lambda x, r: jnp.sum(jmp.route(router_kernel.router_logits(x, r), K).weights * c),
                              (0, 1)))(x, router)
    if np.array_equal(np.asarray(ids), np.asarray(want_ids)):  # the same choice (else other gates)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-3)
    # float32 router weights, cast inside: the gradient reaches them
    g = jax.jit(jax.grad(lambda r: jnp.sum(jmp.route_tokens(x, r, K).weights * c)))(router.astype(jnp.float32))
    assert g.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(g))) and np.any(np.asarray(g) != 0)


def test_vmap_folds_into_tokens():
    B, T, H, E, K = 3, 2, 128, 16, 4
    x, router = random_float((B, T, H), jnp.bfloat16), random_float((H, E), jnp.bfloat16, H ** -0.5)
    bias = random_float((E,), jnp.float32, 0.3)
    ours = jax.jit(jax.vmap(lambda z: jmp.route_tokens(z, router, K, scoring="sigmoid", bias=bias)))(x)
    for b in range(B):
        one = route_tokens(x[b], router, K, scoring="sigmoid", bias=bias)
        np.testing.assert_array_equal(np.asarray(ours.ids[b]), np.asarray(one.ids))
        np.testing.assert_array_equal(np.asarray(ours.weights[b]), np.asarray(one.weights))
    routers = random_float((B, H, E), jnp.bfloat16, H ** -0.5)  # a batched router: the composition
    ours = jax.jit(jax.vmap(lambda z, r: jmp.route_tokens(z, r, K)))(x, routers)
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(ours.ids[b]), np.asarray(route_tokens(x[b], routers[b], K).ids))


def test_takes_the_kernel_where_it_applies():
    x, router = jnp.ones((1, 2048), jnp.bfloat16), jnp.ones((2048, 128), jnp.bfloat16)
    lower = lambda x, r: jax.jit(lambda x, r: jmp.route_tokens(x, r, 8).weights).lower(x, r).as_text()
    kernel = _native.has_target("cuda", "router_hidden") and gemm_primitives.gpu_is_sm90()
    assert (_native.target("router_hidden") in lower(x, router)) == kernel
    assert _native.target("router_hidden") not in lower(jnp.ones((9, 2048), jnp.bfloat16), router)
    assert _native.target("router_hidden") not in lower(x.astype(jnp.float32), router.astype(jnp.float32))


def test_bad_arguments_name_themselves():
    x, router = jnp.ones((2, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="route_tokens: x"):
        jmp.route_tokens(jnp.ones((2, 3, 16)), router, 2)
    with pytest.raises(ValueError, match="route_tokens: x"):
        jmp.route_tokens(jnp.ones((2, 16), jnp.int32), router, 2)
    with pytest.raises(ValueError, match="route_tokens: router"):
        jmp.route_tokens(x, jnp.ones((15, 8)), 2)
    with pytest.raises(ValueError, match="route_tokens: bias"):
        jmp.route_tokens(x, router, 2, bias=jnp.ones(7))
    with pytest.raises(ValueError, match="top_k"):
        jmp.route_tokens(x, router, 9)
    with pytest.raises(ValueError, match="num_groups"):
        jmp.route_tokens(x, router, 2, num_groups=3, topk_groups=1)


def test_speed_rule(monkeypatch):
    """By default the lowering takes the kernel for one token, 64 or more experts and a router of
    at most 1 MiB (where it measured faster), else the composition; forced, the kernel is exact on
    DeepSeek-V3's router too (7168 x 256, sigmoid, groups, bias). T = 2 for the forced check: a
    shape no other test traces route_tokens at, so that its cached lowering is this one's."""
    for name, value in SPEED_RULE.items():
        monkeypatch.setattr(router_kernel, name, value)
    kernel = _native.has_target("cuda", "router_hidden") and gemm_primitives.gpu_is_sm90()
    for (T, H, E), fused in {(1, 2048, 128): kernel, (1, 4096, 128): kernel, (2, 2048, 128): False,
                             (1, 4096, 32): False, (1, 7168, 256): False}.items():
        x, router = random_float((T, H), jnp.bfloat16), random_float((H, E), jnp.bfloat16, H ** -0.5)
        assert fused_here(x, router) == fused, (T, H, E)
    monkeypatch.setattr(router_kernel, "HIDDEN_KERNEL_MAX_TOKENS", router_kernel.HIDDEN_MAX_TOKENS)
    monkeypatch.setattr(router_kernel, "HIDDEN_MAX_ROUTER_BYTES", float("inf"))
    T, H, E = 2, 7168, 256
    x, router = random_float((T, H), jnp.bfloat16), random_float((H, E), jnp.bfloat16, H ** -0.5)
    assert fused_here(x, router) == kernel
    check(T, H, E, 8, with_bias=True, router=router, **DEEPSEEK)
