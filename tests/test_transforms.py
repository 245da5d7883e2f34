"""vmap (one launch for the whole batch), JVP/transpose rules and their compositions."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_moe_permute as jmp
from conftest import assert_bits_equal, random_expert_map, random_float, random_ids

E, L, T, K, H = 6, 4, 13, 3, 5
# The ops are linear or bilinear, so finite differences need no tiny step; a larger one
# keeps float32 rounding out of the numerical derivatives.
EPS = 1e-2


def permute_hidden(h, ids, m, A=4):
    return jmp.moe_permute(h, ids, E, expert_map=m, num_local_experts=L, align_size=A).hidden


# ---- autodiff -----------------------------------------------------------------------------

@pytest.mark.parametrize("align_size", [1, 4])
def test_permute_grads_order2(align_size):
    h, ids, m = random_float((T, H), jnp.float32), random_ids(T, K, E), random_expert_map(E, L)
    check_grads(lambda x: permute_hidden(x, ids, m, align_size), (h,), order=2, modes=["fwd", "rev"], eps=EPS)


@pytest.mark.parametrize("from_permute", [True, False])
def test_unpermute_grads_order2(from_permute):
    if from_permute:
        res = jmp.moe_permute(random_float((T, H), jnp.float32), random_ids(T, K, E), E, expert_map=random_expert_map(E, L),
                              num_local_experts=L, align_size=4)
        rm, R = res.row_map, res.hidden.shape[0]
    else:  # any row_map: invalid rows and rows shared by several entries
        R = 11
        rm = random_ids(T, K, R)
    x, w = random_float((R, H), jnp.float32), random_float((T, K), jnp.float32)
    check_grads(lambda a, b: jmp.moe_unpermute(a, rm, b), (x, w), order=2, modes=["fwd", "rev"], eps=EPS)
    check_grads(lambda a: jmp.moe_unpermute(a, rm), (x,), order=2, modes=["fwd", "rev"], eps=EPS)


def test_gradients_match_reference():
    h, ids, m = random_float((T, H), jnp.float32), random_ids(T, K, E), random_expert_map(E, L)
    R = jmp.moe_permute(h, ids, E, expert_map=m, num_local_experts=L, align_size=4).hidden.shape[0]
    x, w, rm = random_float((R, H), jnp.float32), random_float((T, K), jnp.float32), random_ids(T, K, R)
    ct = random_float((R, H), jnp.float32)
    g_ours = jax.grad(lambda a: jnp.vdot(ct, jmp.moe_permute(a, ids, E, expert_map=m, num_local_experts=L,
                                                             align_size=4)[0]))(h)
    g_ref = jax.grad(lambda a: jnp.vdot(ct, jmp.reference.moe_permute(a, ids, E, expert_map=m, num_local_experts=L,
                                                                      align_size=4)[0]))(h)
    np.testing.assert_allclose(g_ours, g_ref, rtol=1e-5, atol=1e-5)
    cu = random_float((T, H), jnp.float32)
    g_ours = jax.grad(lambda a, b: jnp.vdot(cu, jmp.moe_unpermute(a, rm, b)), argnums=(0, 1))(x, w)
    g_ref = jax.grad(lambda a, b: jnp.vdot(cu, jmp.reference.moe_unpermute(a, rm, b)), argnums=(0, 1))(x, w)
    for a, b in zip(g_ours, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_integer_outputs_have_float0_tangents():
    h, ids = random_float((T, H), jnp.float32), random_ids(T, K, E)
    _, tangents = jax.jvp(lambda a: jmp.moe_permute(a, ids, E), (h,), (jnp.ones_like(h),))
    assert tangents.group_sizes.dtype == jax.dtypes.float0
    assert tangents.row_map.dtype == jax.dtypes.float0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_gradients(dtype):
    h = random_float((T, H), dtype)
    ids = random_ids(T, K, E)
    g = jax.grad(lambda a: jnp.sum(jmp.moe_permute(a, ids, E).hidden.astype(jnp.float32)))(h)
    assert g.dtype == dtype
    counts = np.sum((np.asarray(ids) >= 0) & (np.asarray(ids) < E), axis=1)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.repeat(counts[:, None], H, 1).astype(np.float32))


def expert_matmul(rows, w_experts, group_sizes):
    """ragged_dot spelled with a gather, for vmap (ragged_dot batches over axis 0 only)."""
    expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right",
                              method="compare_all")
    return jnp.einsum("rh,rhf->rf", rows, w_experts[jnp.minimum(expert, w_experts.shape[0] - 1)])


def pipeline(lib, hidden, ids, weights, w_experts, matmul=jax.lax.ragged_dot):
    """permute -> per-expert matmul -> weighted unpermute."""
    hidden_rows, group_sizes, row_map = lib.moe_permute(hidden, ids, E, align_size=4)
    return lib.moe_unpermute(matmul(hidden_rows, w_experts, group_sizes), row_map, weights)


def test_pipeline_gradients_match_reference():
    hidden, ids = random_float((T, H), jnp.float32), random_ids(T, K, E)
    weights, w_experts = random_float((T, K), jnp.float32), random_float((E, H, 7), jnp.float32)
    loss = lambda lib: lambda *a: jnp.sum(jnp.sin(pipeline(lib, *a)))
    g_ours = jax.jit(jax.grad(loss(jmp), argnums=(0, 2, 3)), static_argnums=())(hidden, ids, weights, w_experts)
    g_ref = jax.grad(loss(jmp.reference), argnums=(0, 2, 3))(hidden, ids, weights, w_experts)
    for a, b in zip(g_ours, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# forward permute + unpermute; backward: unpermute's two cotangents (on CUDA one fused call,
# elsewhere scatter + weight_grad) and permute's (an unpermute).
BACKWARD_CALLS = (["permute", "unpermute", "unpermute_bwd"] if jax.default_backend() == "gpu"
                  else ["permute", "scatter", "unpermute", "weight_grad"])


def custom_calls(lowered_text):
    """Names of our FFI targets called in a lowered (StableHLO) program."""
    return re.findall(r"custom_call @jax_moe_permute\.(\w+)", lowered_text)


def test_backward_pass_uses_our_kernels():
    hidden, ids = random_float((T, H), jnp.float32), random_ids(T, K, E)
    weights, w_experts = random_float((T, K), jnp.float32), random_float((E, H, 7), jnp.float32)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(pipeline(jmp, *a)), argnums=(0, 2)))
    calls = custom_calls(g.lower(hidden, ids, weights, w_experts).as_text())
    assert sorted(set(calls)) == BACKWARD_CALLS, calls


# ---- vmap ----------------------------------------------------------------------------------

B = 3


def batched_inputs():
    return (random_float((B, T, H), jnp.float32), random_ids(B * T, K, E).reshape(B, T, K),
            jnp.stack([random_expert_map(E, L) for _ in range(B)]))


@pytest.mark.parametrize("in_axes", [a for a in itertools.product([0, None], repeat=3) if a != (None,) * 3])
@pytest.mark.parametrize("tokens,align_size", [(T, 4), (T, 1), (2, 1)])  # CUDA: three one-launch paths
def test_vmap_permute_matches_loop(in_axes, tokens, align_size):
    hs, idss, ms = batched_inputs()
    hs, idss = hs[:, :tokens], idss[:, :tokens]
    args = [x if ax == 0 else x[0] for x, ax in zip((hs, idss, ms), in_axes)]
    f = lambda h, i, m: jmp.moe_permute(h, i, E, expert_map=m, num_local_experts=L, align_size=align_size)
    got = jax.vmap(f, in_axes=in_axes)(*args)
    for b in range(B):
        want = f(*[x[b] if ax == 0 else x for x, ax in zip(args, in_axes)])
        for g, w in zip(got, want):
            assert_bits_equal(g[b], w)


@pytest.mark.parametrize("in_axes", [a for a in itertools.product([0, None], repeat=3) if a != (None,) * 3])
def test_vmap_unpermute_matches_loop(in_axes):
    R = 17
    xs, rms, ws = random_float((B, R, H), jnp.bfloat16), random_ids(B * T, K, R).reshape(B, T, K), \
        random_float((B, T, K), jnp.float32)
    args = [x if ax == 0 else x[0] for x, ax in zip((xs, rms, ws), in_axes)]
    got = jax.vmap(jmp.moe_unpermute, in_axes=in_axes)(*args)
    for b in range(B):
        want = jmp.moe_unpermute(*[x[b] if ax == 0 else x for x, ax in zip(args, in_axes)])
        assert_bits_equal(got[b], want)


def test_vmap_batch_axis_not_first():
    hs, idss, _ = batched_inputs()
    got = jax.vmap(lambda h, i: jmp.moe_permute(h, i, E), in_axes=(1, 2), out_axes=1)(
        jnp.moveaxis(hs, 0, 1), jnp.moveaxis(idss, 0, 2))
    for b in range(B):
        want = jmp.moe_permute(hs[b], idss[b], E)
        for g, w in zip(got, want):
            assert_bits_equal(jnp.moveaxis(g, 1, 0)[b], w)


def test_nested_vmap():
    hs = random_float((2, B, T, H), jnp.float32)
    idss = random_ids(2 * B * T, K, E).reshape(2, B, T, K)
    # hidden batched on the outer axis only, ids on both.
    f = jax.vmap(jax.vmap(lambda h, i: jmp.moe_permute(h, i, E, align_size=2), in_axes=(None, 0)), in_axes=(0, 0))
    got = f(hs[:, 0], idss)
    for a in range(2):
        for b in range(B):
            want = jmp.moe_permute(hs[a, 0], idss[a, b], E, align_size=2)
            for g, w in zip(got, want):
                assert_bits_equal(g[a, b], w)


def test_vmap_is_one_custom_call_and_no_loop():
    hs, idss, ms = batched_inputs()
    ws = random_float((B, T, K), jnp.float32)

    def f(h, i, m, w):
        res = jmp.moe_permute(h, i, E, expert_map=m, num_local_experts=L)
        return jmp.moe_unpermute(res.hidden * 2, res.row_map, w)

    single = jax.jit(f).lower(hs[0], idss[0], ms[0], ws[0]).as_text()
    batched = jax.jit(jax.vmap(f)).lower(hs, idss, ms, ws).as_text()
    assert "while" not in batched
    assert len(custom_calls(batched)) == len(custom_calls(single)) == 2


@pytest.mark.parametrize("compose", ["jit(vmap(grad))", "grad(vmap)", "vmap(grad)"])
def test_compositions_match_reference(compose):
    hs, idss, _ = batched_inputs()
    ws, w_experts = random_float((B, T, K), jnp.float32), random_float((E, H, 4), jnp.float32)

    def loss(lib):
        return lambda h, i, w: jnp.sum(jnp.tanh(pipeline(lib, h, i, w, w_experts, expert_matmul)))

    def build(lib):
        f = loss(lib)
        if compose == "jit(vmap(grad))":
            return jax.jit(jax.vmap(jax.grad(f, argnums=(0, 2))))
        if compose == "grad(vmap)":
            return jax.grad(lambda h, i, w: jnp.sum(jax.vmap(f)(h, i, w)), argnums=(0, 2))
        return jax.vmap(jax.grad(f, argnums=(0, 2)))

    for a, b in zip(build(jmp)(hs, idss, ws), build(jmp.reference)(hs, idss, ws)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_vmap_of_grad_is_still_batched_kernels():
    hs, idss, _ = batched_inputs()
    ws, w_experts = random_float((B, T, K), jnp.float32), random_float((E, H, 4), jnp.float32)
    g = jax.jit(jax.vmap(jax.grad(lambda h, i, w: jnp.sum(pipeline(jmp, h, i, w, w_experts, expert_matmul)), argnums=(0, 2))))
    text = g.lower(hs, idss, ws).as_text()
    assert "while" not in text
    assert sorted(set(custom_calls(text))) == BACKWARD_CALLS
