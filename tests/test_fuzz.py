"""Property-based tests against the reference: random shapes, ids, maps, dtypes, weights."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_moe_permute as jmp
from conftest import FLOAT_DTYPES, WEIGHT_DTYPES, assert_bits_equal, assert_close

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routings(draw):
    T = draw(st.integers(0, 40))
    H = draw(st.sampled_from([0, 1, 2, 3, 7, 8, 16, 33]))
    E = draw(st.integers(1, 12))
    K = draw(st.integers(1, 10))  # K > E included
    A = draw(st.sampled_from([1, 2, 3, 8, 128]))
    seed = draw(st.integers(0, 2**31 - 1))
    use_map = draw(st.booleans())
    L = draw(st.integers(1, E + 2)) if use_map else E
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rng = np.random.default_rng(seed)
    hidden = (rng.standard_normal((T, H)) + 0.5).astype(np.float32)
    ids = rng.integers(-2, E + 2, (T, K)).astype(np.int32)
    expert_map = rng.integers(-1, L + 1, E).astype(np.int32) if use_map else None
    return jnp.asarray(hidden).astype(dtype), jnp.asarray(ids), E, expert_map, L, A, rng


@SETTINGS
@given(routings())
def test_permute_fuzz(case):
    hidden, ids, E, expert_map, L, A, _ = case
    kw = dict(expert_map=expert_map, num_local_experts=L if expert_map is not None else None, align_size=A)
    got = jax.jit(lambda h, i: jmp.moe_permute(h, i, E, **kw))(hidden, ids)
    want = jmp.reference.moe_permute(hidden, ids, E, **kw)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)


@SETTINGS
@given(routings(), st.sampled_from([None] + WEIGHT_DTYPES), st.sampled_from([None, jnp.float32, jnp.bfloat16]))
def test_unpermute_fuzz(case, weights_dtype, out_dtype):
    hidden, ids, E, expert_map, L, A, rng = case
    T, K = ids.shape
    R = int(rng.integers(0, 3 * T * K + 2))
    x = jnp.asarray(rng.standard_normal((R, hidden.shape[1])).astype(np.float32)).astype(hidden.dtype)
    rm = jnp.asarray(rng.integers(-2, R + 2, (T, K)).astype(np.int32))
    w = None if weights_dtype is None else jnp.asarray(rng.standard_normal((T, K)).astype(np.float32)).astype(
        weights_dtype)
    got = jax.jit(lambda a, r, b: jmp.moe_unpermute(a, r, b, out_dtype=out_dtype))(x, rm, w)
    want = jmp.reference.moe_unpermute(x, rm, w, out_dtype=out_dtype)
    assert_close(got, want, got.dtype)


@SETTINGS
@given(routings())
def test_gradients_fuzz(case):
    hidden, ids, E, expert_map, L, A, rng = case
    hidden = hidden.astype(jnp.float32)
    kw = dict(expert_map=expert_map, num_local_experts=L if expert_map is not None else None, align_size=A)
    T, K = ids.shape
    w = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))

    def loss(lib):
        def f(h, weights):
            rows, _, rm = lib.moe_permute(h, ids, E, **kw)
            return jnp.sum(jnp.sin(lib.moe_unpermute(rows * 1.5, rm, weights)))
        return jax.grad(f, argnums=(0, 1))

    for g, r in zip(jax.jit(loss(jmp))(hidden, w), loss(jmp.reference)(hidden, w)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
