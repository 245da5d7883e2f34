"""Tile-aware token rounding (route(..., token_rounding=TokenRounding(...))) against a plain
NumPy statement of its rule: which (token, expert) entries survive, their gates, the rounded
counts, every mode, ties, T = 0, K = E, E not a power of two, sigmoid with groups; gradients,
jit, vmap, moe_mlp and the modules on rounded routing; bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_moe_permute as jmp
from jax_moe_permute import TokenRounding
from conftest import random_float
from test_layer import assert_allclose, dense_moe


def scores_np(logits, scoring):
    z = np.asarray(logits, np.float64)
    if scoring == "softmax":
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return 1 / (1 + np.exp(-z))


def expected(logits, plain, rounding, K, scoring="softmax", renormalize=True, scale=1.0):
    """The rule in loops: ({(t, e): gate} of the rounded routing, from route's own top-k `plain`;
    its columns; the experts that lost an entry to a token's lack of extra slots)."""
    T, E = logits.shape
    s = np.asarray(jmp.reference.router_scores(jnp.asarray(logits, jnp.float32), scoring))  # float32, as route
    ids, w = np.asarray(plain.ids), np.asarray(plain.weights)
    chosen = {(t, int(e)): float(w[t, k]) for t in range(T) for k, e in enumerate(ids[t])}
    tile, mode = rounding.tile, rounding.mode
    default = {"up": K, "nearest": (K + 1) // 2, "down": 0}[mode]
    extra = rounding.extra_slots if rounding.extra_slots is not None else default
    keep = set()
    for e in range(E):
        c = sum((t, e) in chosen for t in range(T))
        n = {"up": -(-c // tile), "down": c // tile, "nearest": (c + tile // 2) // tile}[mode] * tile
        n = min(n, T)
        # chosen tokens first, each part by score, then the lower token
        ranked = sorted(range(T), key=lambda t: ((t, e) not in chosen, -s[t, e], t))
        keep |= {(t, e) for t in ranked[:n]}
    out, capped = {}, set()
    for t in range(T):
        denom = 1.0
        if renormalize:
            denom = s[t, ids[t]].sum() + (1e-20 if scoring == "sigmoid" else 0.0)
        added = sorted((e for e in range(E) if (t, e) in keep and (t, e) not in chosen), key=lambda e: (-s[t, e], e))
        for e in added[:extra]:
            out[(t, e)] = s[t, e] / denom * scale
        capped |= set(added[extra:])
        for e in ids[t]:
            if (t, int(e)) in keep:
                out[(t, int(e))] = chosen[(t, int(e))]
    return out, K + extra, capped


def entries(r):
    ids, w = np.asarray(r.ids), np.asarray(r.weights)
    got = {}
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                assert (t, int(ids[t, k])) not in got, "an expert twice for one token"
                got[(t, int(ids[t, k]))] = float(w[t, k])
            else:
                assert w[t, k] == 0.0
    return got


def check(logits, K, rounding, **kw):
    plain = jmp.route(logits, K, **kw)
    r = jax.jit(lambda z: jmp.route(z, K, token_rounding=rounding, **kw))(logits)
    want, cols, capped = expected(logits, plain, rounding, K, kw.get("scoring", "softmax"), kw.get("renormalize", True),
                          kw.get("routed_scaling_factor", 1.0))
    assert r.ids.shape == r.weights.shape == (logits.shape[0], cols)
    got = entries(r)
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-6, atol=1e-7)
    # The kept top-k entries stay in their slots, best first; the extra slots follow by score.
    ids = np.asarray(r.ids)
    np.testing.assert_array_equal(np.where(ids[:, :K] >= 0, np.asarray(plain.ids), -1), ids[:, :K])
    counts = np.bincount(ids[ids >= 0], minlength=logits.shape[1])
    np.testing.assert_array_equal(np.asarray(r.aux.tokens_per_expert), counts)
    # Every count lands on a multiple of the tile (or on T), except where a token ran out of slots.
    tile = rounding.tile
    assert all(c % tile == 0 or c == logits.shape[0] or e in capped for e, c in enumerate(counts))
    return r, counts, capped


@pytest.mark.parametrize("mode", ["nearest", "up", "down"])
@pytest.mark.parametrize("T,E,K,tile", [(40, 6, 2, 8), (33, 5, 3, 4), (16, 4, 4, 4), (9, 3, 1, 16), (64, 8, 2, 8)])
def test_matches_rule(mode, T, E, K, tile):
    logits = random_float((T, E), jnp.float32, 2.0)
    check(logits, K, TokenRounding(tile, mode))


def test_sigmoid_groups_scale_and_few_slots():
    logits = random_float((48, 8), jnp.float32, 2.0)
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    check(logits, 2, TokenRounding(8, "up", extra_slots=1), **kw)
    check(logits, 2, TokenRounding(8, "nearest"), renormalize=False, **kw)


def test_ties_and_tile_one():
    # Equal scores everywhere: the lower token wins each tie; tile 1 changes nothing.
    logits = jnp.zeros((10, 4), jnp.float32)
    check(logits, 2, TokenRounding(4, "nearest"))
    check(logits, 2, TokenRounding(4, "up"))
    logits = random_float((12, 5), jnp.float32)
    plain = jmp.route(logits, 2)
    r = jmp.route(logits, 2, token_rounding=TokenRounding(1))
    np.testing.assert_array_equal(np.asarray(r.ids[:, :2]), np.asarray(plain.ids))
    np.testing.assert_array_equal(np.asarray(r.weights[:, :2]), np.asarray(plain.weights))
    assert (np.asarray(r.ids[:, 2:]) == -1).all()


def test_empty_and_k_equals_e():
    r = jmp.route(jnp.zeros((0, 4)), 2, token_rounding=TokenRounding(8))
    assert r.ids.shape == (0, 3) and r.weights.shape == (0, 3)
    assert (np.asarray(r.aux.tokens_per_expert) == 0).all()
    check(random_float((6, 3), jnp.float32), 3, TokenRounding(4, "down"))


def test_route_tokens_and_vmap():
    x, router = random_float((24, 8), jnp.float32), random_float((8, 6), jnp.float32)
    rounding = TokenRounding(4, "nearest")
    r = jmp.route_tokens(x, router, 2, token_rounding=rounding)
    want = jmp.route(x @ router, 2, token_rounding=rounding)
    np.testing.assert_array_equal(np.asarray(r.ids), np.asarray(want.ids))
    assert_allclose(r.weights, want.weights)
    logits = random_float((3, 20, 5), jnp.float32)
    batched = jax.jit(jax.vmap(lambda z: jmp.route(z, 2, token_rounding=rounding)))(logits)
    for b in range(3):
        one = jmp.route(logits[b], 2, token_rounding=rounding)
        np.testing.assert_array_equal(np.asarray(batched.ids[b]), np.asarray(one.ids))
        assert_allclose(batched.weights[b], one.weights, 1e-6)


def test_gradients():
    """The gates are differentiable in the logits (the choice is not): checked where no small
    step changes the rounded choice."""
    rounding = TokenRounding(4, "nearest")
    for attempt in range(50):
        logits = random_float((12, 5), jnp.float32, 2.0)
        ids = np.asarray(jmp.route(logits, 2, token_rounding=rounding).ids)
        keys = jax.random.split(jax.random.PRNGKey(attempt), 16)
        if all(np.array_equal(ids, np.asarray(jmp.route(logits + 1e-2 * jax.random.normal(k, logits.shape), 2,
                                                         token_rounding=rounding).ids)) for k in keys):
            break
    else:
        raise AssertionError("no logits away from a switch")
    coef = random_float(ids.shape, jnp.float32)
    f = lambda z: jnp.sum(jmp.route(z, 2, token_rounding=rounding).weights * coef)
    check_grads(jax.jit(f), (logits,), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-3)


def test_moe_mlp_on_rounded_routing():
    T, E, K, H, F = 40, 6, 2, 8, 5
    r = jmp.route(random_float((T, E), jnp.float32, 2.0), K, token_rounding=TokenRounding(8))
    assert (np.asarray(r.ids) < 0).any()  # the case is not vacuous: some entries dropped or unused
    x, w_in, w_out = random_float((T, H), jnp.float32), random_float((E, H, 2 * F), jnp.float32, 0.5), \
        random_float((E, F, H), jnp.float32, 0.5)
    ours = lambda x, w, wi, wo: jmp.moe_mlp(x, w, r.ids, wi, wo)
    ref = lambda x, w, wi, wo: dense_moe(x, w, r.ids, wi, wo)
    assert_allclose(jax.jit(ours)(x, r.weights, w_in, w_out), ref(x, r.weights, w_in, w_out))
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    for a, b in zip(jax.grad(loss(ours), (0, 1, 2, 3))(x, r.weights, w_in, w_out),
                    jax.grad(loss(ref), (0, 1, 2, 3))(x, r.weights, w_in, w_out)):
        assert_allclose(a, b, 1e-4)


def test_modules_take_it():
    pytest.importorskip("flax")
    from flax import nnx

    from jax_moe_permute import linen, nnx as jnnx

    rounding = TokenRounding(8, "up")
    x = random_float((2, 20, 16), jnp.float32)
    model = jnnx.MoE(16, 8, 4, 2, rngs=nnx.Rngs(0), token_rounding=rounding)
    y, aux = model(x, return_aux=True)
    assert y.shape == x.shape and int(aux.tokens_per_expert.sum()) % 8 == 0
    lin = linen.MoE(16, 8, 4, 2, token_rounding=rounding)
    params = lin.init(jax.random.PRNGKey(0), x)
    assert lin.apply(params, x).shape == x.shape
    with pytest.raises(ValueError, match="token_rounding.mode"):
        jnnx.MoE(16, 8, 4, 2, rngs=nnx.Rngs(0), token_rounding=TokenRounding(8, "sideways"))


def test_bad_arguments():
    logits = random_float((4, 4), jnp.float32)
    with pytest.raises(ValueError, match="token_rounding.tile"):
        jmp.route(logits, 2, token_rounding=TokenRounding(0))
    with pytest.raises(TypeError, match="token_rounding.tile"):
        jmp.route(logits, 2, token_rounding=TokenRounding(8.5))
    with pytest.raises(ValueError, match="token_rounding.mode"):
        jmp.route(logits, 2, token_rounding=TokenRounding(8, "random"))
    with pytest.raises(ValueError, match="token_rounding.extra_slots"):
        jmp.route(logits, 2, token_rounding=TokenRounding(8, "up", -1))
    with pytest.raises(TypeError, match="token_rounding must be a TokenRounding"):
        jmp.route(logits, 2, token_rounding=128)
