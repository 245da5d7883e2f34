"""moe_permute against the reference and against the contract, line by line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from conftest import FLOAT_DTYPES, assert_bits_equal, random_expert_map, random_float, random_ids

# (T, H, E, K): T in {0, 1, odd, >=1000}, H in {1, odd, 4096}, E in {1, 3, 256}, K up to 8 and K > E.
SHAPES = [
    (0, 8, 4, 2),
    (1, 1, 1, 1),
    (1, 7, 3, 8),
    # On CUDA: up to 32 entries without padding are routed by one warp; up to 2048 by counts
    # in every block (below, rows in several chunks, and more experts than blocks).
    (4, 4096, 256, 8),
    (11, 3, 8, 3),
    (37, 4096, 64, 4),
    (40, 24, 600, 2),
    (37, 33, 3, 8),
    (37, 1, 256, 4),
    (129, 4096, 8, 2),
    (1000, 64, 256, 8),
    (1031, 5, 1, 3),
    # On CUDA: more than 2048 entries take the tiled sort, more than 1023 local experts the
    # radix-sort fallback.
    (700, 16, 64, 4),
    (2048, 8, 512, 8),  # tiles of 1024 entries, two tile shares per offsets thread
    (4096, 4, 1000, 8),  # tiles of 2048, more tiles per offsets thread than it keeps in registers
    (300, 16, 2000, 8),
    (5, 3, 1500, 2),
    # Tiled rows of one vector or none take a thread per entry: 2 and 16 bytes, and H = 0.
    (700, 1, 64, 4),
    (600, 8, 300, 8),
    (3000, 0, 16, 2),
]


def check_against_reference(hidden, ids, E, *, expert_map=None, num_local_experts=None, align_size=1, jit=True):
    kw = dict(expert_map=expert_map, num_local_experts=num_local_experts, align_size=align_size)
    ours = lambda h, i: jmp.moe_permute(h, i, E, **kw)
    ref = lambda h, i: jmp.reference.moe_permute(h, i, E, **kw)
    if jit:
        ours, ref = jax.jit(ours), jax.jit(ref)
    got, want = ours(hidden, ids), ref(hidden, ids)
    assert isinstance(got, jmp.PermuteResult)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    return got


@pytest.mark.parametrize("T,H,E,K", SHAPES)
@pytest.mark.parametrize("align_size", [1, 4, 128])
@pytest.mark.parametrize("with_map", [False, True])
def test_matches_reference(T, H, E, K, align_size, with_map):
    hidden = random_float((T, H), jnp.bfloat16)
    ids = random_ids(T, K, E)
    if with_map:
        L = max(1, E // 2 + 1)
        check_against_reference(hidden, ids, E, expert_map=random_expert_map(E, L), num_local_experts=L,
                                align_size=align_size)
    else:
        check_against_reference(hidden, ids, E, align_size=align_size)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("jit", [False, True])
def test_every_dtype_eager_and_jit(dtype, jit):
    hidden = random_float((57, 40), dtype)
    check_against_reference(hidden, random_ids(57, 4, 16), 16, align_size=4, jit=jit)


@pytest.mark.parametrize("ids_dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.int32, jnp.uint32])
def test_any_integer_ids(ids_dtype):
    hidden = random_float((20, 9), jnp.float32)
    ids = random_ids(20, 3, 5, low=0).astype(ids_dtype)
    check_against_reference(hidden, ids, 5)


def numpy_permute(hidden, ids, E, expert_map, L, A):
    """The contract, spelled out entry by entry."""
    hidden, ids = np.asarray(hidden), np.asarray(ids)
    T, K = ids.shape
    local = np.full((T, K), -1)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if 0 <= e < E:
                l = e if expert_map is None else int(expert_map[e])
                if 0 <= l < L:
                    local[t, k] = l
    counts = np.array([(local == j).sum() for j in range(L)])
    sizes = (counts + A - 1) // A * A
    N = T * K
    R = N if A == 1 else (N + min(N, L) * (A - 1)) // A * A
    out = np.zeros((R,) + hidden.shape[1:], hidden.dtype)
    row_map = np.full((T, K), -1)
    start = 0
    for j in range(L):
        row = start
        for i in range(N):  # ascending flat index t*K+k
            if local.flat[i] == j:
                row_map.flat[i] = row
                out[row] = hidden[i // K]
                row += 1
        start += sizes[j]
    return out, sizes.astype(np.int32), row_map.astype(np.int32)


@pytest.mark.parametrize("A", [1, 3, 8])
@pytest.mark.parametrize("with_map", [False, True])
def test_contract_by_hand(A, with_map):
    T, K, E, H = 23, 5, 6, 3
    hidden = random_float((T, H), jnp.float32)
    ids = random_ids(T, K, E)
    L = 4 if with_map else E
    expert_map = random_expert_map(E, L) if with_map else None
    got = jmp.moe_permute(hidden, ids, E, expert_map=expert_map, num_local_experts=L if with_map else None,
                          align_size=A)
    want = numpy_permute(hidden, ids, E, None if expert_map is None else np.asarray(expert_map), L, A)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert int(np.sum(got.group_sizes)) <= got.hidden.shape[0]
    assert np.all(np.asarray(got.group_sizes) % A == 0)


def test_duplicates_get_their_own_rows():
    hidden = random_float((4, 6), jnp.float32)
    ids = jnp.array([[2, 2, 2], [0, 2, 0], [5, -1, 2], [1, 1, 1]], jnp.int32)
    res = jmp.moe_permute(hidden, ids, 3)
    rm = np.asarray(res.row_map)
    valid = rm[rm >= 0]
    assert len(set(valid.tolist())) == len(valid) == 10
    assert rm[2, 0] == -1 and rm[2, 1] == -1
    np.testing.assert_array_equal(np.asarray(res.group_sizes), [2, 3, 5])
    for t in range(4):
        for k in range(3):
            if rm[t, k] >= 0:
                np.testing.assert_array_equal(np.asarray(res.hidden)[rm[t, k]], np.asarray(hidden)[t])


def test_all_dropped_gives_zero_rows():
    hidden = random_float((9, 5), jnp.bfloat16)
    ids = jnp.full((9, 2), 7, jnp.int32)
    res = jmp.moe_permute(hidden, ids, 4, align_size=4)
    assert np.all(np.asarray(res.row_map) == -1)
    assert np.all(np.asarray(res.group_sizes) == 0)
    assert not np.any(np.asarray(res.hidden.astype(jnp.float32)))


@pytest.mark.parametrize("T,K,L,A", [(5, 2, 3, 1), (5, 2, 3, 4), (1, 8, 256, 128), (100, 8, 4, 16)])
def test_row_count_formula(T, K, L, A):
    res = jax.eval_shape(lambda h, i: jmp.moe_permute(h, i, L, align_size=A),
                         jax.ShapeDtypeStruct((T, 4), jnp.float32), jax.ShapeDtypeStruct((T, K), jnp.int32))
    N = T * K
    assert res.hidden.shape[0] == (N if A == 1 else (N + min(N, L) * (A - 1)) // A * A)


def test_worst_case_fills_every_row():
    # Every one of min(N, L) experts gets a count that is 1 mod A (5, 1, 1): the bound is reached.
    A, L = 4, 3
    ids = jnp.array([[0], [1], [2], [0], [0], [0], [0]], jnp.int32)
    res = jmp.moe_permute(random_float((7, 2), jnp.float32), ids, L, align_size=A)
    assert int(np.sum(res.group_sizes)) == res.hidden.shape[0] == 16  # 8 + 4 + 4


def test_h_zero_and_t_zero():
    res = jmp.moe_permute(jnp.ones((6, 0), jnp.float32), random_ids(6, 2, 3), 3, align_size=2)
    assert res.hidden.shape[1] == 0
    res = jmp.moe_permute(jnp.ones((0, 5), jnp.bfloat16), jnp.zeros((0, 3), jnp.int32), 3)
    assert res.hidden.shape == (0, 5) and res.row_map.shape == (0, 3)
    np.testing.assert_array_equal(np.asarray(res.group_sizes), [0, 0, 0])


def test_result_is_a_pytree():
    res = jmp.moe_permute(random_float((3, 4), jnp.float32), random_ids(3, 2, 4, low=0), 4)
    assert len(jax.tree.leaves(res)) == 3
    out = jax.jit(lambda r: r)(res)
    assert isinstance(out, jmp.PermuteResult)


@pytest.mark.parametrize("T,E", [(30, 8), (700, 64), (300, 1100)])
def test_vmap_folds_the_batch_on_every_path(T, E):
    K, B = 4, 3
    hidden = random_float((B, T, 8), jnp.bfloat16)
    ids = random_ids(B * T, K, E).reshape(B, T, K)
    f = lambda h, i: jmp.moe_permute(h, i, E, align_size=4)
    got = jax.jit(jax.vmap(f))(hidden, ids)
    for b in range(B):
        want = jmp.reference.moe_permute(hidden[b], ids[b], E, align_size=4)
        for g, w in zip(got, want):
            assert_bits_equal(g[b], w)


def test_expert_map_is_traced():
    # One compiled function serves every expert_map.
    f = jax.jit(lambda h, i, m: jmp.moe_permute(h, i, 8, expert_map=m, num_local_experts=2))
    hidden, ids = random_float((30, 4), jnp.float32), random_ids(30, 2, 8)
    for _ in range(3):
        m = random_expert_map(8, 2)
        got = f(hidden, ids, m)
        want = jmp.reference.moe_permute(hidden, ids, 8, expert_map=m, num_local_experts=2)
        for g, w in zip(got, want):
            assert_bits_equal(g, w)


def test_ragged_dot_pipeline():
    T, H, F, E, K = 40, 16, 8, 4, 2
    hidden = random_float((T, H), jnp.float32)
    ids = random_ids(T, K, E, low=0, high_extra=0)
    weights = jax.nn.softmax(random_float((T, K), jnp.float32), axis=-1)
    w_experts = random_float((E, H, F), jnp.float32, scale=0.1)
    res = jmp.moe_permute(hidden, ids, E, align_size=8)
    y = jax.lax.ragged_dot(res.hidden, w_experts, res.group_sizes)
    out = jmp.moe_unpermute(y, res.row_map, weights)
    want = sum(weights[:, k, None] * jnp.einsum("th,thf->tf", hidden, w_experts[ids[:, k]]) for k in range(K))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_lowering_uses_our_custom_call():
    text = jax.jit(lambda h, i: jmp.moe_permute(h, i, 4)).lower(
        jnp.ones((3, 4), jnp.float32), jnp.zeros((3, 2), jnp.int32)).as_text()
    assert "jax_moe_permute.permute" in text
