"""route's fused router kernel against the jnp route it replaces (routing.reference_route): ids
bit-equal, weights to float32 rounding, gradients equal, under jit and vmap; on CPU the C++
kernel, on a GPU the CUDA one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute import _native, router_kernel, routing
from conftest import fresh_key, random_float

STATIC = ("scoring", "renormalize", "num_groups", "topk_groups", "routed_scaling_factor")
fused_route = jax.jit(jmp.route, static_argnums=1, static_argnames=STATIC)
reference_route = jax.jit(routing.reference_route, static_argnums=1, static_argnames=STATIC)


def assert_same_routing(a, b):
    np.testing.assert_array_equal(np.asarray(a.ids), np.asarray(b.ids))
    assert a.weights.dtype == jnp.float32 and a.ids.dtype == jnp.int32
    # Softmax divides by a sum of E terms and renormalisation by one of K, each added in another
    # order than XLA's: their rounding grows with the terms.
    E, K = a.aux.tokens_per_expert.shape[0], a.ids.shape[-1]
    rtol = 1e-6 * max(1, K / 8, E / 256)
    np.testing.assert_allclose(np.asarray(a.weights), np.asarray(b.weights), rtol=rtol, atol=1e-30)


def check(logits, K, **kw):
    ours, ref = fused_route(logits, K, **kw), reference_route(logits, K, **kw)
    assert_same_routing(ours, ref)
    return ours


def tied_logits(shape, dtype=jnp.float32, values=5):
    """Integers from a small range: many exactly equal scores in every row."""
    return jax.random.randint(fresh_key(), shape, -values // 2, values - values // 2).astype(dtype)


def test_route_takes_the_kernel():
    hlo = jax.jit(lambda z: jmp.route(z, 2).weights).lower(jnp.ones((4, 8))).as_text()
    backend = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    if _native.has_target(backend, "router"):
        assert _native.target("router") in hlo
    hlo = jax.jit(lambda z: routing.reference_route(z, 2).weights).lower(jnp.ones((4, 8))).as_text()
    assert _native.target("router") not in hlo


@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (37, 6, 2), (64, 60, 4), (20, 129, 8), (5, 128, 8), (9, 3, 3),
                                   (4, 1, 1), (11, 1024, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax(T, E, K, renormalize):
    check(random_float((T, E), jnp.float32, 2.0), K, renormalize=renormalize)


@pytest.mark.parametrize("T,E,K,groups,topk_groups", [(29, 16, 4, 4, 2), (33, 256, 8, 8, 4), (7, 12, 3, 6, 3),
                                                      (10, 60, 5, None, None), (6, 8, 8, 1, 1), (5, 64, 4, 64, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sigmoid_groups_bias(T, E, K, groups, topk_groups, with_bias):
    bias = random_float((E,), jnp.float32, 0.3) if with_bias else None
    for renormalize in (True, False):
        check(random_float((T, E), jnp.float32, 2.0), K, scoring="sigmoid", bias=bias, num_groups=groups,
              topk_groups=topk_groups, renormalize=renormalize, routed_scaling_factor=2.5)


def test_softmax_with_bias_and_groups():
    check(random_float((40, 32), jnp.float32, 2.0), 3, bias=random_float((32,), jnp.float32, 0.05), num_groups=4,
          topk_groups=2, routed_scaling_factor=0.7)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,K,groups", [(8, 2, None), (60, 6, None), (256, 8, 8), (129, 129, None)])
def test_ties(scoring, E, K, groups):
    kw = dict(scoring=scoring, num_groups=groups, topk_groups=None if groups is None else groups // 2)
    r = check(tied_logits((50, E)), K, **kw)
    equal_rows = jnp.full((3, E), 0.75)  # every expert equal: 0..K-1
    r = check(equal_rows, K, **kw)
    if groups is None:
        np.testing.assert_array_equal(np.asarray(r.ids), np.broadcast_to(np.arange(K), (3, K)))
    check(tied_logits((20, E)), K, bias=tied_logits((E,), values=3) * 0.25, **kw)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_k_equals_e(scoring):
    for E in (1, 5, 33, 100):
        r = check(random_float((13, E), jnp.float32, 2.0), E, scoring=scoring)
        np.testing.assert_array_equal(np.sort(np.asarray(r.ids), axis=1), np.broadcast_to(np.arange(E), (13, E)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_logit_dtypes(dtype, scoring):
    check(random_float((45, 64), dtype, 2.0), 6, scoring=scoring)
    check(tied_logits((20, 24), dtype), 3, scoring=scoring)


def test_empty_and_one_token():
    for scoring in ("softmax", "sigmoid"):
        empty = check(random_float((0, 8), jnp.float32), 2, scoring=scoring)
        assert empty.ids.shape == (0, 2) and empty.weights.shape == (0, 2)
        assert float(empty.aux.load_balance_loss) == 0.0
        check(random_float((1, 7), jnp.float32), 3, scoring=scoring)


def test_many_tokens():
    check(random_float((3000, 64), jnp.float32, 2.0), 6)
    check(random_float((3000, 256), jnp.float32, 2.0), 8, scoring="sigmoid", bias=random_float((256,), jnp.float32, 0.2),
          num_groups=8, topk_groups=4, routed_scaling_factor=2.5)


def test_aux_matches():
    logits = random_float((50, 16), jnp.float32, 2.0)
    for scoring in ("softmax", "sigmoid"):
        a, b = fused_route(logits, 3, scoring=scoring), reference_route(logits, 3, scoring=scoring)
        np.testing.assert_array_equal(np.asarray(a.aux.tokens_per_expert), np.asarray(b.aux.tokens_per_expert))
        np.testing.assert_allclose(float(a.aux.load_balance_loss), float(b.aux.load_balance_loss), rtol=1e-6)
        np.testing.assert_allclose(float(a.aux.router_z_loss), float(b.aux.router_z_loss), rtol=1e-6)


def test_unused_aux_is_not_computed():
    # An inference call that reads only weights and ids keeps the kernel and nothing of the aux.
    hlo = jax.jit(lambda z: jmp.route(z, 2)[:2]).lower(jnp.ones((4, 8))).compile().as_text()
    backend = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    if _native.has_target(backend, "router"):
        for op in (" log(", " exponential(", " scatter(", " reduce("):
            assert op not in hlo, op


@pytest.mark.parametrize("kw", [dict(), dict(renormalize=False, routed_scaling_factor=1.5),
                                dict(scoring="sigmoid", bias=None, num_groups=4, topk_groups=2, routed_scaling_factor=2.5),
                                dict(scoring="sigmoid", renormalize=False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match(kw, dtype):
    logits = random_float((12, 16), dtype, 2.0)
    ct = random_float((12, 3), jnp.float32)

    def loss(route):
        def f(z):
            r = route(z, 3, **kw)
            return jnp.sum(r.weights * ct) + 0.1 * r.aux.router_z_loss + 0.3 * r.aux.load_balance_loss
        return f

    ours = jax.jit(jax.grad(loss(jmp.route)))(logits)
    ref = jax.jit(jax.grad(loss(routing.reference_route)))(logits)
    assert ours.dtype == dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), rtol=1e-5, atol=1e-6)


def test_second_order_and_jvp():
    logits = random_float((6, 8), jnp.float32, 2.0)
    f = lambda route: lambda z: jnp.sum(route(z, 2).weights ** 2 * jnp.arange(1.0, 3.0))
    hess = lambda route: jax.jit(jax.hessian(f(route)))(logits)
    np.testing.assert_allclose(np.asarray(hess(jmp.route)), np.asarray(hess(routing.reference_route)), rtol=1e-5,
                               atol=1e-6)
    t = random_float((6, 8), jnp.float32)
    jvp = lambda route: jax.jvp(lambda z: route(z, 2).weights, (logits,), (t,))[1]
    np.testing.assert_allclose(np.asarray(jvp(jmp.route)), np.asarray(jvp(routing.reference_route)), rtol=1e-5,
                               atol=1e-6)


def test_vmap():
    logits = random_float((3, 5, 24), jnp.float32, 2.0)
    bias = random_float((24,), jnp.float32, 0.3)
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2)
    ours = jax.jit(jax.vmap(lambda z: jmp.route(z, 3, bias=bias, **kw)))(logits)
    for b in range(3):
        assert_same_routing(jax.tree.map(lambda x: x[b], ours), reference_route(logits[b], 3, bias=bias, **kw))
    hlo = jax.jit(jax.vmap(lambda z: jmp.route(z, 3, bias=bias, **kw).weights)).lower(logits).as_text()
    assert hlo.count(_native.target("router")) <= 1  # one call for the batch where the kernel is built


def test_vmap_batched_bias_and_nested():
    logits = random_float((2, 3, 7, 16), jnp.float32, 2.0)
    biases = random_float((2, 16), jnp.float32, 0.3)
    f = lambda z, b: jmp.route(z, 2, scoring="sigmoid", bias=b)
    ours = jax.jit(jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, 0)))(logits, biases)
    only_bias = jax.jit(jax.vmap(f, in_axes=(None, 0)))(logits[0, 0], biases)
    for i in range(2):
        assert_same_routing(jax.tree.map(lambda x: x[i], only_bias),
                            reference_route(logits[0, 0], 2, scoring="sigmoid", bias=biases[i]))
        for j in range(3):
            assert_same_routing(jax.tree.map(lambda x: x[i, j], ours),
                                reference_route(logits[i, j], 2, scoring="sigmoid", bias=biases[i]))


def test_vmap_of_grad():
    logits = random_float((4, 6, 8), jnp.float32, 2.0)
    f = lambda route: lambda z: jnp.sum(route(z, 2, scoring="sigmoid").weights * jnp.arange(1.0, 3.0))
    ours = jax.jit(jax.vmap(jax.grad(f(jmp.route))))(logits)
    ref = jax.jit(jax.vmap(jax.grad(f(routing.reference_route))))(logits)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_eager():
    logits = random_float((9, 10), jnp.float32, 2.0)
    assert_same_routing(jmp.route(logits, 3), routing.reference_route(logits, 3))


def test_more_experts_than_the_kernel_holds_use_jnp():
    E = router_kernel.MAX_EXPERTS + 1
    logits = random_float((3, E), jnp.float32, 2.0)
    hlo = jax.jit(lambda z: jmp.route(z, 2).weights).lower(logits).as_text()
    assert _native.target("router") not in hlo
    check(logits, 2)


def test_token_threshold(monkeypatch):
    monkeypatch.setattr(routing, "FUSED_ROUTE_MAX_TOKENS", 4)
    small = jax.jit(lambda z: jmp.route(z, 2).weights).lower(jnp.ones((4, 8))).as_text()
    large = jax.jit(lambda z: jmp.route(z, 2).weights).lower(jnp.ones((5, 8))).as_text()
    assert _native.target("router") not in large
    if _native.target("router") in jax.jit(lambda z: routing.route(z, 2).weights).lower(jnp.ones((1, 8))).as_text():
        assert _native.target("router") in small


@pytest.mark.parametrize("args,kw,match", [
    ((9,), {}, "top_k"),
    ((0,), {}, "top_k"),
    ((2,), dict(scoring="tanh"), "scoring"),
    ((2,), dict(num_groups=3, topk_groups=1), "num_groups"),
    ((2,), dict(num_groups=4), "topk_groups"),
    ((2,), dict(num_groups=4, topk_groups=5), "topk_groups"),
    ((4,), dict(num_groups=4, topk_groups=1), "top_k"),
    ((2,), dict(bias=jnp.ones(7)), "bias"),
])
def test_bad_arguments(args, kw, match):
    logits = random_float((3, 8), jnp.float32)
    for route in (jmp.route, routing.reference_route):
        with pytest.raises((ValueError, TypeError), match=match):
            route(logits, *args, **kw)
    with pytest.raises(TypeError, match="logits"):
        jmp.route(jnp.ones((3, 8), jnp.int32), 2)


def test_kernel_rejects_bad_shapes():
    # The handler checks what the Python layer guarantees: a direct bind of inconsistent shapes.
    with pytest.raises(ValueError, match="bias"):
        router_kernel.router_p.bind(jnp.ones((3, 8)), jnp.ones((2, 8)), top_k=2, scoring="softmax",
                                    renormalize=True, num_groups=0, topk_groups=0, scale=1.0, has_bias=True)
