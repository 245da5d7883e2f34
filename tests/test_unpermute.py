"""moe_unpermute against the reference: float32 accumulation, invalid rows, every dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from conftest import FLOAT_DTYPES, WEIGHT_DTYPES, assert_bits_equal, assert_close, random_float, random_ids

# (T, R, H, K). On CUDA the gather issues 2, 4 or 8 row loads at a time (by K and grid size):
# K = 3 and 12 on grids large enough for 4 leave partial batches; (1001, 2100, 1024, 2) and
# (601, 900, 24, 1) are K <= 2 on grids that fill the GPU, odd token counts.
SHAPES = [(0, 4, 8, 2), (1, 1, 1, 1), (1, 9, 7, 8), (37, 50, 33, 3), (129, 300, 4096, 2), (1000, 8000, 64, 8),
          (700, 2100, 40, 3), (600, 7000, 16, 12), (1001, 2100, 1024, 2), (601, 900, 24, 1)]


def random_row_map(T, K, R):
    """Rows in [-2, R + 2): invalid rows and rows shared by several entries included."""
    return random_ids(T, K, R)


def check(x, row_map, weights=None, out_dtype=None, jit=True):
    ours = lambda a, r, w: jmp.moe_unpermute(a, r, w, out_dtype=out_dtype)
    ref = lambda a, r, w: jmp.reference.moe_unpermute(a, r, w, out_dtype=out_dtype)
    if jit:
        ours, ref = jax.jit(ours), jax.jit(ref)
    got, want = ours(x, row_map, weights), ref(x, row_map, weights)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, got.dtype)
    return got


@pytest.mark.parametrize("T,R,H,K", SHAPES)
@pytest.mark.parametrize("weights_dtype", [None] + WEIGHT_DTYPES)
def test_matches_reference(T, R, H, K, weights_dtype):
    x = random_float((R, H), jnp.bfloat16)
    w = None if weights_dtype is None else random_float((T, K), weights_dtype)
    check(x, random_row_map(T, K, R), w)


# On CUDA, grids that small narrow each thread's access (16 bytes down to 2) by K and grid size:
# bf16 (T, K) = (1, 2) takes 8 bytes, (2, 8) at H = 7168 4 bytes, (2, 8) at H = 2048 2 bytes;
# (3, 4) 8 bytes again; float32 and float8 stop at their own limits.
@pytest.mark.parametrize("T,R,H,K", [(1, 40, 4096, 2), (2, 30, 7168, 8), (2, 60, 2048, 8), (3, 50, 7168, 4)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_small_grids_match_reference(T, R, H, K, dtype):
    check(random_float((R, H), dtype), random_row_map(T, K, R), random_float((T, K), jnp.float32))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_every_dtype(dtype, out_dtype, jit):
    x = random_float((60, 24), dtype)
    check(x, random_row_map(31, 4, 60), random_float((31, 4), jnp.float32), out_dtype=out_dtype, jit=jit)


def test_accumulates_in_float32():
    # 1 + 2^-9 + 2^-9 rounds differently when summed in bfloat16.
    x = jnp.array([[1.0], [2.0**-9], [2.0**-9]], jnp.bfloat16)
    out = jmp.moe_unpermute(x, jnp.array([[0, 1, 2]]), out_dtype=jnp.float32)
    assert float(out[0, 0]) == 1.0 + 2.0**-8


def test_invalid_rows_contribute_nothing():
    x = random_float((5, 3), jnp.float32)
    x = x.at[0].set(jnp.inf)  # would poison the sum if an invalid entry read row 0
    rm = jnp.array([[-1, 7], [5, -3], [1, 2]], jnp.int32)
    out = np.asarray(jmp.moe_unpermute(x, rm, random_float((3, 2), jnp.float32)))
    assert np.all(out[:2] == 0)
    assert np.all(np.isfinite(out))


def test_int64_indices_do_not_wrap():
    with jax.enable_x64(True):
        x = random_float((4, 2), jnp.float32)
        rm = jnp.array([[2**32 + 1, 1]], jnp.int64)  # row 1 + 2^32 would be row 1 if it wrapped
        np.testing.assert_array_equal(np.asarray(jmp.moe_unpermute(x, rm))[0], np.asarray(x)[1])
        ids = jnp.array([[2**32 + 1], [1]], jnp.int64)
        res = jmp.moe_permute(random_float((2, 3), jnp.float32), ids, 4)
        np.testing.assert_array_equal(np.asarray(res.row_map), [[-1], [0]])


def test_roundtrip_with_permute():
    T, H, E, K = 64, 16, 8, 2
    hidden = random_float((T, H), jnp.float32)
    ids = random_ids(T, K, E, low=0, high_extra=0)
    w = random_float((T, K), jnp.float32)
    res = jmp.moe_permute(hidden, ids, E, align_size=4)
    out = jmp.moe_unpermute(res.hidden, res.row_map, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(hidden * w.sum(-1, keepdims=True)), rtol=1e-5, atol=1e-5)


def test_deterministic():
    x = random_float((500, 256), jnp.bfloat16)
    rm, w = random_row_map(400, 8, 500), random_float((400, 8), jnp.float32)
    f = jax.jit(jmp.moe_unpermute)
    first = f(x, rm, w)
    for _ in range(3):
        assert_bits_equal(f(x, rm, w), first)


def test_batched_matches_a_loop():
    """vmap over 3 examples (one launch, batch strides) of an odd token count, K = 2, on a grid
    that fills the GPU."""
    B, T, R, H, K = 3, 333, 700, 2048, 2
    xs, ws = random_float((B, R, H), jnp.bfloat16), random_float((B, T, K), jnp.float32)
    rms = jnp.stack([random_row_map(T, K, R) for _ in range(B)])
    got = jax.jit(jax.vmap(jmp.moe_unpermute))(xs, rms, ws)
    for b in range(B):
        assert_bits_equal(got[b], jax.jit(jmp.moe_unpermute)(xs[b], rms[b], ws[b]))
        assert_close(got[b], jmp.reference.moe_unpermute(xs[b], rms[b], ws[b]), jnp.bfloat16)


# The residual in the unpermute equals the add after the op bit for bit: small grids (T = 1, 5)
# and grid-stride ones (1001 tokens) on CUDA, odd H (scalar accesses), T = 0.
@pytest.mark.parametrize("T,R,H,K", [(0, 4, 8, 2), (1, 9, 2048, 8), (5, 30, 7, 3), (64, 512, 2048, 8),
                                     (1001, 2100, 1024, 2)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_residual_equals_the_add_after(T, R, H, K, dtype):
    x, rm, w = random_float((R, H), dtype), random_row_map(T, K, R), random_float((T, K), jnp.float32)
    out_dtype = jnp.float32 if jnp.dtype(dtype).itemsize == 1 else dtype
    residual = random_float((T, H), out_dtype, scale=4.0)
    got = jax.jit(lambda a, r, w, res: jmp.moe_unpermute(a, r, w, residual=res))(x, rm, w, residual)
    want = jax.jit(lambda a, r, w, res: jmp.moe_unpermute(a, r, w, out_dtype=out_dtype) + res)(x, rm, w, residual)
    assert got.dtype == jnp.dtype(out_dtype)
    assert_bits_equal(got, want)


def test_residual_gradients_and_vmap():
    T, R, H, K = 33, 70, 40, 3
    x, rm, w = random_float((R, H), jnp.bfloat16), random_row_map(T, K, R), random_float((T, K), jnp.float32)
    residual, ct = random_float((T, H), jnp.bfloat16), random_float((T, H), jnp.float32)
    fused = lambda a, w, res: jnp.vdot(ct, jmp.moe_unpermute(a, rm, w, residual=res).astype(jnp.float32))
    after = lambda a, w, res: jnp.vdot(ct, (jmp.moe_unpermute(a, rm, w) + res).astype(jnp.float32))
    for g, h in zip(jax.jit(jax.grad(fused, argnums=(0, 1, 2)))(x, w, residual),
                    jax.jit(jax.grad(after, argnums=(0, 1, 2)))(x, w, residual)):
        assert_bits_equal(g, h)
    # in a tangent's place (linear in x and the residual together): its transpose
    ct16 = ct.astype(jnp.bfloat16)
    for g, h in zip(jax.linear_transpose(lambda a, res: jmp.moe_unpermute(a, rm, w, residual=res), x, residual)(ct16),
                    jax.linear_transpose(lambda a, res: jmp.moe_unpermute(a, rm, w) + res, x, residual)(ct16)):
        assert_bits_equal(g, h)
    # vmapped residual over one shared x (batch extents 1 and 3), and the other way round
    residuals = random_float((3, T, H), jnp.bfloat16)
    got = jax.jit(jax.vmap(lambda res: jmp.moe_unpermute(x, rm, w, residual=res)))(residuals)
    xs = random_float((3, R, H), jnp.bfloat16)
    got_xs = jax.jit(jax.vmap(lambda a: jmp.moe_unpermute(a, rm, w, residual=residual)))(xs)
    for b in range(3):
        assert_bits_equal(got[b], jmp.moe_unpermute(x, rm, w) + residuals[b])
        assert_bits_equal(got_xs[b], jmp.moe_unpermute(xs[b], rm, w) + residual)


def test_residual_errors():
    x, rm = random_float((20, 16), jnp.bfloat16), random_row_map(5, 2, 20)
    with pytest.raises(ValueError, match="residual must have shape"):
        jmp.moe_unpermute(x, rm, residual=jnp.zeros((5, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="residual must have shape .* dtype float32"):
        jmp.moe_unpermute(x, rm, out_dtype=jnp.float32, residual=jnp.zeros((5, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="residual must be an array"):
        jmp.moe_unpermute(x, rm, residual=[[0.0] * 16] * 5)


def test_h_zero():
    out = jmp.moe_unpermute(jnp.ones((4, 0), jnp.float32), random_row_map(3, 2, 4))
    assert out.shape == (3, 0)


# Gradients w.r.t. expert rows and weights together: on CUDA one fused pass (rows owned by one
# entry written by its token, rows nothing maps to zeroed, rows of several entries summed in
# entry order); elsewhere scatter + weight_grad. (T, R, H, K): permute-made maps are injective;
# these random ones share rows, hold invalid ones and leave rows empty. On CUDA, up to 1024
# entries and 8192 rows take one launch with a block per entry: the first six shapes. Larger
# ones take the token pass: (300, 700, 2048, 8) 8 warps per token, (260, 3000, 1024, 10) two
# groups of entries, (50, 9000, 64, 2) too many rows for one launch, (4000, 20000, 256, 4) one
# warp per token because the tokens alone fill the GPU.
BWD_SHAPES = [(1, 9, 7, 8), (37, 50, 33, 3), (64, 600, 2048, 8), (300, 700, 4096, 2), (5, 3, 16, 12),
              (50, 400, 1024, 10), (300, 700, 2048, 8), (260, 3000, 1024, 10), (50, 9000, 64, 2),
              (4000, 20000, 256, 4)]


@pytest.mark.parametrize("T,R,H,K", BWD_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_gradients_of_rows_and_weights_match_reference(T, R, H, K, dtype):
    x, w, rm = random_float((R, H), dtype), random_float((T, K), jnp.float32), random_row_map(T, K, R)
    ct = random_float((T, H), jnp.float32)

    def grads(lib, rows):
        return jax.jit(jax.grad(lambda a, b: jnp.vdot(ct, lib.moe_unpermute(a, rm, b, out_dtype=jnp.float32)),
                                argnums=(0, 1)))(rows, w)

    # The reference in float32 (in x's dtype it would round each entry's share of a row before
    # adding); ours sums in float32 and rounds once.
    (gx, gw), (rx, rw) = grads(jmp, x), grads(jmp.reference, x.astype(jnp.float32))
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    assert_close(gx, rx.astype(dtype), dtype)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-4, atol=1e-4)


def test_gradients_through_a_permute_made_map_in_bfloat16():
    """bfloat16 throughout, as in training (on CUDA 16-byte vectors of 8 values): permute's map
    sends every entry to a row of its own, so each row is written by its token alone."""
    T, E, K, H = 4000, 16, 4, 512
    rm = jmp.moe_permute(random_float((T, H), jnp.bfloat16), random_ids(T, K, E, low=0, high_extra=0), E).row_map
    x = random_float((T * K, H), jnp.bfloat16)
    w, ct = random_float((T, K), jnp.bfloat16), random_float((T, H), jnp.bfloat16)

    def grads(lib):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(ct * lib.moe_unpermute(a, rm, b)).astype(jnp.float32),
                                argnums=(0, 1)))(x, w)

    (gx, gw), (rx, rw) = grads(jmp), grads(jmp.reference)
    assert gx.dtype == rx.dtype == jnp.bfloat16 and gw.dtype == rw.dtype == jnp.bfloat16
    assert_bits_equal(gx, rx)  # one rounding of w * ct either way
    assert_close(gw, rw, jnp.bfloat16)


@pytest.mark.parametrize("T,R,H,K", [(37, 50, 33, 3), (300, 700, 64, 8)])
def test_batched_gradients_match_a_loop(T, R, H, K):
    """vmap(grad): one launch for the batch on either CUDA path (2400 entries take the token
    pass), the row map shared by the batch (batch stride 0)."""
    B = 3
    xs, ws = random_float((B, R, H), jnp.bfloat16), random_float((B, T, K), jnp.float32)
    rm, cts = random_row_map(T, K, R), random_float((B, T, H), jnp.float32)

    def grads(x, w, ct):
        return jax.grad(lambda a, b: jnp.vdot(ct, jmp.moe_unpermute(a, rm, b, out_dtype=jnp.float32)),
                        argnums=(0, 1))(x, w)

    got = jax.jit(jax.vmap(grads))(xs, ws, cts)
    for b in range(B):
        want = jax.jit(grads)(xs[b], ws[b], cts[b])
        assert_bits_equal(got[0][b], want[0])
        np.testing.assert_allclose(np.asarray(got[1][b]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
