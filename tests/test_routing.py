"""route(): top-k choices and gates against numpy restatements of Hugging Face's routers
(Mixtral / Qwen3-MoE softmax, DeepSeek-V3 sigmoid with bias and groups), aux losses, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_moe_permute as jmp
from jax_moe_permute import routing
from conftest import random_float

# Jitted: one compile per configuration instead of one per eager op (CI has two cores).
STATIC = ("scoring", "renormalize", "num_groups", "topk_groups", "routed_scaling_factor")
route = jax.jit(jmp.route, static_argnums=1, static_argnames=STATIC)  # the router kernel where it is built
reference_route = jax.jit(routing.reference_route, static_argnums=1, static_argnames=STATIC)  # separate XLA ops


def np_softmax_route(logits, K, renormalize):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: softmax in float32, top-k, optional renorm."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    w = np.take_along_axis(p, ids, -1)
    if renormalize:
        w /= w.sum(-1, keepdims=True)
    return w, ids


def np_deepseek_route(logits, K, bias, n_group, topk_group, renormalize, scale):
    """DeepseekV3TopkRouter.get_topk_indices + forward."""
    T, E = logits.shape
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = s + bias[None]
    group = np.sort(choice.reshape(T, n_group, E // n_group), -1)[..., -2:].sum(-1)
    best = np.argsort(-group, -1, kind="stable")[:, :topk_group]
    mask = np.zeros((T, n_group), bool)
    np.put_along_axis(mask, best, True, -1)
    choice = np.where(np.repeat(mask, E // n_group, 1), choice, -np.inf)
    ids = np.argsort(-choice, -1, kind="stable")[:, :K]
    w = np.take_along_axis(s, ids, -1)
    if renormalize:
        w /= w.sum(-1, keepdims=True) + 1e-20
    return w * scale, ids


@pytest.mark.parametrize("T,E,K,dtype,renormalize", [
    (1, 8, 2, jnp.float32, True), (37, 8, 2, jnp.bfloat16, False), (20, 128, 8, jnp.float32, False),
    (20, 128, 8, jnp.float32, True), (5, 3, 3, jnp.bfloat16, True), (4, 1, 1, jnp.float32, False)])
@pytest.mark.parametrize("impl", ["kernel", "jnp"])
def test_softmax_matches_hf(T, E, K, dtype, renormalize, impl):
    logits = random_float((T, E), dtype, scale=2.0)
    r = (route if impl == "kernel" else reference_route)(logits, K, renormalize=renormalize)
    w, ids = np_softmax_route(np.asarray(logits.astype(jnp.float32)), K, renormalize)
    assert r.weights.dtype == jnp.float32 and r.ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(r.ids), ids)
    np.testing.assert_allclose(np.asarray(r.weights), w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("E,K,groups,topk_groups", [(16, 4, 4, 2), (32, 8, 8, 4), (8, 2, 1, 1), (12, 3, 6, 3)])
@pytest.mark.parametrize("impl", ["kernel", "jnp"])
def test_sigmoid_groups_bias_match_deepseek(E, K, groups, topk_groups, impl):
    renormalize = E % 8 == 0  # both settings across the cases
    T = 29
    logits = random_float((T, E), jnp.float32, scale=2.0)
    bias = random_float((E,), jnp.float32, scale=0.3)
    r = (route if impl == "kernel" else reference_route)(logits, K, scoring="sigmoid", bias=bias, num_groups=groups, topk_groups=topk_groups,
                  renormalize=renormalize, routed_scaling_factor=2.5)
    w, ids = np_deepseek_route(np.asarray(logits), K, np.asarray(bias), groups, topk_groups, renormalize, 2.5)
    np.testing.assert_array_equal(np.asarray(r.ids), ids)
    np.testing.assert_allclose(np.asarray(r.weights), w, rtol=1e-6, atol=1e-7)


def test_bias_steers_choice_not_weights():
    T, E, K = 16, 8, 2
    logits = random_float((T, E), jnp.float32)
    bias = jnp.zeros(E).at[5].set(100.0)  # expert 5 always chosen
    r = route(logits, K, scoring="sigmoid", bias=bias, renormalize=False)
    assert np.all(np.asarray(r.ids)[:, 0] == 5)
    np.testing.assert_allclose(np.asarray(r.weights[:, 0]), np.asarray(jax.nn.sigmoid(logits[:, 5])), rtol=1e-6)


def test_groups_restrict_choice():
    T, E, K = 32, 16, 4
    r = route(random_float((T, E), jnp.float32, 2.0), K, scoring="sigmoid", num_groups=4, topk_groups=1)
    groups = np.asarray(r.ids) // 4
    assert np.all(groups == groups[:, :1])  # all K from the one group allowed


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_aux(scoring):
    T, E, K = 50, 8, 3
    logits = random_float((T, E), jnp.float32, 2.0)
    r = route(logits, K, scoring=scoring)
    ids = np.asarray(r.ids)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(r.aux.tokens_per_expert), counts)
    z = np.asarray(logits, np.float64)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True) if scoring == "softmax" else 1 / (1 + np.exp(-z))
    p = p / p.sum(-1, keepdims=True)
    lb = E * np.sum(counts / T * p.mean(0))
    np.testing.assert_allclose(float(r.aux.load_balance_loss), lb, rtol=1e-5)
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(float(r.aux.router_z_loss), np.mean(lse**2), rtol=1e-5)


def test_balanced_router_loss_is_k():
    # Every token's logits equal: probabilities uniform; K-way choice spreads evenly when the
    # tokens are rotated copies.
    E, K = 4, 2
    logits = jnp.stack([jnp.roll(jnp.array([3.0, 2.0, 0.0, 0.0]), t) for t in range(E)])
    r = route(logits, K)
    np.testing.assert_array_equal(np.asarray(r.aux.tokens_per_expert), [2, 2, 2, 2])
    np.testing.assert_allclose(float(r.aux.load_balance_loss), K, rtol=1e-6)


def logits_away_from_switches(shape, K, kw, tries=50):
    """Random logits whose choice (top-k and group choice) no small perturbation changes:
    check_grads' finite differences (steps of 1e-3 along a random normal direction) must not cross
    a switch, where the function has no derivative."""
    for attempt in range(tries):
        logits = random_float(shape, jnp.float32, 2.0)
        ids = np.asarray(jmp.route(logits, K, **kw).ids)
        keys = jax.random.split(jax.random.PRNGKey(attempt), 16)
        if all(np.array_equal(ids, np.asarray(jmp.route(logits + 1e-2 * jax.random.normal(k, shape), K, **kw).ids))
               for k in keys):
            return logits
    raise AssertionError("no logits away from a switch")


@pytest.mark.parametrize("kw", [dict(renormalize=False),
                                dict(scoring="sigmoid", num_groups=2, topk_groups=1, routed_scaling_factor=1.5)])
def test_gradients(kw):
    logits = logits_away_from_switches((6, 8), 2, kw)

    def f(z):
        r = jmp.route(z, 2, **kw)
        return (r.weights * jnp.arange(1.0, 3.0)).sum() + 0.1 * r.aux.router_z_loss + 0.5 * r.aux.load_balance_loss

    # float32 central differences carry |f| * 1e-7 / eps of rounding: a small f (the z loss, about
    # lse^2 ~ 25, scaled down) and eps = 1e-3 keep that far below the tolerance for every seed.
    check_grads(jax.jit(f), (logits,), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-3)


def test_jit_vmap_and_empty():
    logits = random_float((3, 5, 8), jnp.float32)
    batched = jax.jit(jax.vmap(lambda z: jmp.route(z, 2)))(logits)
    for b in range(3):
        one = route(logits[b], 2)
        np.testing.assert_array_equal(np.asarray(batched.ids[b]), np.asarray(one.ids))
        np.testing.assert_allclose(np.asarray(batched.weights[b]), np.asarray(one.weights), rtol=1e-6)
    empty = route(jnp.zeros((0, 8)), 2)
    assert empty.ids.shape == (0, 2) and float(empty.aux.load_balance_loss) == 0.0
    assert float(empty.aux.router_z_loss) == 0.0


def test_balance_bias():
    bias = jnp.zeros(4)
    new = jmp.balance_bias(bias, jnp.array([10, 2, 4, 4]), rate=0.1)
    np.testing.assert_allclose(np.asarray(new), [-0.1, 0.1, 0.1, 0.1])


@pytest.mark.parametrize("args,kw,match", [
    ((9,), {}, "top_k"),
    ((0,), {}, "top_k"),
    ((2,), dict(scoring="tanh"), "scoring"),
    ((2,), dict(num_groups=3, topk_groups=1), "num_groups"),
    ((2,), dict(num_groups=4), "topk_groups"),
    ((2,), dict(num_groups=4, topk_groups=5), "topk_groups"),
    ((4,), dict(num_groups=4, topk_groups=1), "top_k"),
    ((2,), dict(bias=jnp.zeros(7)), "bias"),
])
def test_bad_arguments(args, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jmp.route(jnp.ones((3, 8)), *args, **kw)
    with pytest.raises(ValueError, match="logits"):
        jmp.route(jnp.ones((8,)), 2)
