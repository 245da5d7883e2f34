"""The fused decode MLP (decode_mlp.moe_mlp_decode): the primitive against the dense reference on
every backend (its unfused lowering on CPU), its batching and JVP; on the GPU the fused kernels
themselves, chosen by moe_mlp for decode-sized calls: every activation and dtype, invalid and
repeated ids, expert_map, Mixtral's long F rows, forced on shapes the rule would not pick,
bitwise reproducible, equal to the unfused path to rounding, gradients through the JVP rule; each
in both of the kernels' forms (the split form and the slice form, forced by the launch's switch
JAX_MOE_PERMUTE_DECODE_MLP), and the slice form at every cluster size."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute import decode_mlp
from conftest import needs_gpu, random_float
from test_layer import assert_allclose, dense_moe, layer_inputs

ACTIVATIONS = ["swiglu", "geglu", "gelu", "relu"]
FUSED_TARGET = "jax_moe_permute.moe_mlp_decode"
FORMS = ["split", "slices"]  # the kernels' two forms (cpp/gemm/moe_mlp_decode.cu)


@pytest.fixture(params=FORMS)
def form(request, monkeypatch):
    """Forces one form of the fused kernels (read at every launch: each test traces afresh)."""
    monkeypatch.setenv("JAX_MOE_PERMUTE_DECODE_MLP", request.param)
    return request.param


def with_bad_ids(ids, E):
    """Token 0 gets an id past the experts, -1 and a repeat of its first expert where K allows."""
    ids = np.array(ids)
    K = ids.shape[1]
    ids[0, -1] = E
    if K > 1:
        ids[0, 0] = -1
    if K > 2:
        ids[0, 1] = ids[0, 2]
    return jnp.asarray(ids)


def assert_close_to(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(float(np.abs(b).max()), 1.0) if b.size else 1.0
    assert a.shape == b.shape
    assert float(np.abs(a - b).max(initial=0.0)) <= tol * scale


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("T,E,K,H,F", [(3, 8, 2, 16, 24), (1, 4, 4, 8, 3), (0, 4, 2, 8, 8), (5, 1, 1, 5, 2)])
def test_primitive_matches_dense(activation, T, E, K, H, F):
    x, w, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation)
    if T:
        ids = with_bad_ids(ids, E)
    f = jax.jit(functools.partial(decode_mlp.moe_mlp_decode, activation=activation))
    assert_allclose(f(x, w, ids, w_in, w_out), dense_moe(x, w, ids, w_in, w_out, activation=activation))


def test_primitive_vmap_and_jvp():
    V, T, E, K, H, F = 3, 4, 6, 2, 8, 5
    batch = [layer_inputs(T, E, K, H, F) for _ in range(V)]
    x, w, ids, w_in, w_out = (jnp.stack(a) for a in zip(*batch))
    f = functools.partial(decode_mlp.moe_mlp_decode, activation="swiglu")
    out = jax.jit(jax.vmap(f, (0, 0, 0, None, None)))(x, w, ids, w_in[0], w_out[0])
    for v in range(V):
        assert_allclose(out[v], dense_moe(x[v], w[v], ids[v], w_in[0], w_out[0]))
    primals = (x[0], w[0], w_in[0], w_out[0])
    tangents = tuple(random_float(p.shape, jnp.float32) for p in primals)
    run = lambda g: jax.jit(lambda: jax.jvp(lambda a, b, c, d: g(a, b, ids[0], c, d), primals, tangents))()
    (o, d), (o_ref, d_ref) = run(f), run(dense_moe)
    assert_allclose(o, o_ref)
    assert_allclose(d, d_ref, 1e-4)


# ---- GPU: the fused kernels ------------------------------------------------------------------

def decode_inputs(T, E, K, H, F, activation="swiglu", dtype=jnp.bfloat16):
    """layer_inputs with weights scaled by 1 / sqrt(fan-in), so float16 sums stay finite."""
    x, w, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation, dtype)
    return x, w, ids, (w_in * H ** -0.5).astype(dtype), (w_out * F ** -0.5).astype(dtype)


def fused_call(activation="swiglu", **kw):
    """A freshly traced jitted moe_mlp (the kernel choice is made when it is traced)."""
    return jax.jit(lambda x, w, ids, wi, wo: jmp.moe_mlp(x, w, ids, wi, wo, activation=activation, **kw))


def lowered_text(f, *args):
    return f.lower(*args).as_text()


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("T,E,K,H,F", [
    (1, 128, 8, 2048, 768),  # Qwen3-30B-A3B at T = 1
    (4, 64, 4, 264, 48),     # T * K = 16 = E / 4: the rule's edge; H not a multiple of 256
    (1, 16, 1, 8, 8),        # one pair, H = 8
    (1, 32, 4, 2056, 136),   # 9 strips of output columns (more than a block's warps), a partial F slice
])
def test_fused_matches_dense(dtype, activation, T, E, K, H, F, form):
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F, activation, dtype)
    ids = with_bad_ids(ids, E)
    f = fused_call(activation)
    assert FUSED_TARGET in lowered_text(f, x, w, ids, w_in, w_out)
    got = f(x, w, ids, w_in, w_out)
    f32 = lambda a: a.astype(jnp.float32)
    want = dense_moe(f32(x), w, ids, f32(w_in), f32(w_out), activation=activation)
    assert got.dtype == dtype
    assert_close_to(got, want, 2e-2)
    np.testing.assert_array_equal(np.asarray(f(x, w, ids, w_in, w_out), np.float32), np.asarray(got, np.float32))


@needs_gpu
def test_fused_long_rows_and_unfused_agree(monkeypatch, form):
    """Mixtral's decode shape (F = 14336: more than one shared-memory range of F rows per block)
    against the unfused path (a CUTLASS tile forced) to rounding."""
    T, E, K, H, F = 1, 8, 2, 4096, 14336
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    fused = fused_call()
    assert FUSED_TARGET in lowered_text(fused, x, w, ids, w_in, w_out)
    got = fused(x, w, ids, w_in, w_out)
    monkeypatch.setenv("MOE_GROUPED_GEMM_TILE", "64x256")
    unfused = fused_call()
    assert FUSED_TARGET not in lowered_text(unfused, x, w, ids, w_in, w_out)
    assert_close_to(got, unfused(x, w, ids, w_in, w_out), 2e-2)
    f32 = lambda a: a.astype(jnp.float32)
    assert_close_to(got, dense_moe(f32(x), w, ids, f32(w_in), f32(w_out)), 2e-2)


@needs_gpu
@pytest.mark.parametrize("T,E,K", [(5, 1, 1), (7, 3, 2), (33, 16, 8)])
def test_fused_forced(T, E, K, monkeypatch, form):
    """MOE_GROUPED_GEMM_TILE=decode takes the fused kernels past the rule: E = 1, many pairs per expert."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_TILE", "decode")
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, 64, 40)
    ids = with_bad_ids(ids, E)
    f = fused_call()
    assert FUSED_TARGET in lowered_text(f, x, w, ids, w_in, w_out)
    f32 = lambda a: a.astype(jnp.float32)
    assert_close_to(f(x, w, ids, w_in, w_out), dense_moe(f32(x), w, ids, f32(w_in), f32(w_out)), 2e-2)


@needs_gpu
@pytest.mark.parametrize("T,E,K,H,F", [
    (2, 300, 300, 16, 8),  # K past one block of staged gates (256): the last block's sum in two chunks
    (1, 8, 2, 8200, 16),   # H past one shared-memory slice of x (8192 rows): at least two splits of H
])
def test_fused_many_pairs_and_long_x(T, E, K, H, F, monkeypatch, form):
    monkeypatch.setenv("MOE_GROUPED_GEMM_TILE", "decode")
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    ids = with_bad_ids(ids, E)
    f = fused_call()
    assert FUSED_TARGET in lowered_text(f, x, w, ids, w_in, w_out)
    f32 = lambda a: a.astype(jnp.float32)
    assert_close_to(f(x, w, ids, w_in, w_out), dense_moe(f32(x), w, ids, f32(w_in), f32(w_out)), 2e-2)


@needs_gpu
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_slice_form_cluster_sizes(cluster, monkeypatch):
    """The slice form with each cluster size (H split over 1-8 blocks, a cluster's w_out rows
    shared among them): the dense reference, the split form to rounding, and bitwise repeatable."""
    T, E, K, H, F = 2, 32, 4, 2056, 200
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    ids = with_bad_ids(ids, E)
    monkeypatch.setenv("JAX_MOE_PERMUTE_DECODE_MLP", "split")
    split = fused_call()(x, w, ids, w_in, w_out)
    monkeypatch.setenv("JAX_MOE_PERMUTE_DECODE_MLP", "slices")
    monkeypatch.setenv("JAX_MOE_PERMUTE_DECODE_CLUSTER", str(cluster))
    f = fused_call()
    assert FUSED_TARGET in lowered_text(f, x, w, ids, w_in, w_out)
    got = f(x, w, ids, w_in, w_out)
    f32 = lambda a: a.astype(jnp.float32)
    assert_close_to(got, dense_moe(f32(x), w, ids, f32(w_in), f32(w_out)), 2e-2)
    assert_close_to(got, split, 2e-2)
    np.testing.assert_array_equal(np.asarray(f(x, w, ids, w_in, w_out), np.float32), np.asarray(got, np.float32))


@needs_gpu
def test_slice_form_wide_output(monkeypatch):
    """H' = 8192 on one block a cluster: more than the default 48 KB of shared memory (the opt-in)."""
    monkeypatch.setenv("JAX_MOE_PERMUTE_DECODE_MLP", "slices")
    monkeypatch.setenv("JAX_MOE_PERMUTE_DECODE_CLUSTER", "1")
    T, E, K, H, F = 1, 8, 2, 8192, 16
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    f = fused_call()
    assert FUSED_TARGET in lowered_text(f, x, w, ids, w_in, w_out)
    f32 = lambda a: a.astype(jnp.float32)
    assert_close_to(f(x, w, ids, w_in, w_out), dense_moe(f32(x), w, ids, f32(w_in), f32(w_out)), 2e-2)


@needs_gpu
def test_fused_expert_map_and_grads():
    """A local share of the experts (expert_map), and gradients at a decode shape (the JVP rule's
    unfused path) against the dense reference."""
    T, E, K, H, F, L = 2, 64, 4, 128, 32, 32  # T * K = L / 4 pairs
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    local = jnp.arange(0, E, E // L)
    expert_map = jnp.full(E, -1, jnp.int32).at[local].set(jnp.arange(L))
    ids = ids.at[0, 0].set(int(local[3]))  # at least one pair is local
    f = fused_call(expert_map=expert_map, num_local_experts=L)
    assert FUSED_TARGET in lowered_text(f, x, w, ids, w_in[local], w_out[local])
    f32 = lambda a: a.astype(jnp.float32)
    want = dense_moe(f32(x), w, ids, f32(w_in[local]), f32(w_out[local]), expert_ids=local)
    assert_close_to(f(x, w, ids, w_in[local], w_out[local]), want, 2e-2)

    ct = random_float((T, H), jnp.float32)
    loss = lambda g: lambda x, w, wi, wo: jnp.vdot(g(x, w, ids, wi, wo).astype(jnp.float32), ct)
    grads = jax.jit(jax.grad(loss(fused_call()), (0, 1, 2, 3)))(x, w, w_in, w_out)
    ref = jax.grad(loss(dense_moe), (0, 1, 2, 3))(f32(x), w, f32(w_in), f32(w_out))
    for a, b in zip(grads, ref):
        assert_close_to(a, b, 3e-2)


# ---- The block's residual add (moe_mlp's `residual`) -------------------------------------------

def residual_pair(activation="swiglu", **kw):
    """moe_mlp with `residual` and the plain `r + moe_mlp(...)`, each freshly jitted."""
    fused = jax.jit(lambda x, w, ids, wi, wo, r: jmp.moe_mlp(x, w, ids, wi, wo, activation=activation, residual=r,
                                                              **kw))
    plain = jax.jit(lambda x, w, ids, wi, wo, r: r + jmp.moe_mlp(x, w, ids, wi, wo, activation=activation, **kw))
    return fused, plain


@pytest.mark.parametrize("T,E,K,H,F", [(1, 64, 4, 16, 8), (6, 8, 2, 24, 16), (0, 4, 2, 8, 8)])
def test_residual_equals_the_add(T, E, K, H, F):
    """Equal to the add after the call (bitwise: one rounding of the same sum), on a decode-sized
    and a larger call; gradients through both the same; the unfused primitive (CPU) too."""
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    r = random_float((T, H), jnp.bfloat16)
    fused, plain = residual_pair()
    np.testing.assert_array_equal(np.asarray(fused(x, w, ids, w_in, w_out, r), np.float32),
                                  np.asarray(plain(x, w, ids, w_in, w_out, r), np.float32))
    primitive = jax.jit(lambda *a: decode_mlp.moe_mlp_decode(*a[:5], activation="swiglu", residual=a[5]))
    assert_close_to(primitive(x, w, ids, w_in, w_out, r), plain(x, w, ids, w_in, w_out, r), 2e-2)
    if not T:
        return
    loss = lambda call: jax.jit(jax.grad(lambda x, wi, r: jnp.sum(call(x, w, ids, wi, w_out, r).astype(jnp.float32)
                                                                  ** 2), argnums=(0, 1, 2)))
    for got, want in zip(loss(fused)(x, w_in, r), loss(plain)(x, w_in, r)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    batched = jax.jit(jax.vmap(lambda x, r: jmp.moe_mlp(x, w, ids, w_in, w_out, residual=r)))
    stacked_x, stacked_r = jnp.stack([x, -x]), jnp.stack([r, r])
    for v in range(2):
        assert_close_to(batched(stacked_x, stacked_r)[v], plain(stacked_x[v], w, ids, w_in, w_out, r), 2e-2)


@needs_gpu
def test_unfused_residual_in_the_unpermute():
    """Above decode sizes (the CUTLASS path) the residual rides in the unpermute's launch."""
    x, w, ids, w_in, w_out = decode_inputs(64, 16, 4, 256, 128)
    fused, plain = residual_pair()
    assert "jax_moe_permute.unpermute_add" in lowered_text(fused, x, w, ids, w_in, w_out, x)
    np.testing.assert_array_equal(np.asarray(fused(x, w, ids, w_in, w_out, x), np.float32),
                                  np.asarray(plain(x, w, ids, w_in, w_out, x), np.float32))


def test_residual_bad_arguments():
    x, w, ids, w_in, w_out = decode_inputs(2, 4, 2, 8, 8)
    for bad in (jnp.zeros((2, 9), jnp.bfloat16), jnp.zeros((3, 8), jnp.bfloat16), jnp.zeros((2, 8), jnp.float32)):
        with pytest.raises(ValueError, match="residual"):
            jmp.moe_mlp(x, w, ids, w_in, w_out, residual=bad)


@needs_gpu
@pytest.mark.parametrize("T,E,K,H,F", [(1, 128, 8, 2048, 768), (4, 64, 4, 264, 48)])
def test_fused_residual(T, E, K, H, F, form):
    """The fused kernels add the residual in their last launch: the add's own kernel is gone, the
    result equal to it bitwise; the stacked form too."""
    x, w, ids, w_in, w_out = decode_inputs(T, E, K, H, F)
    ids = with_bad_ids(ids, E)
    fused, plain = residual_pair()
    assert FUSED_TARGET + "_residual" in lowered_text(fused, x, w, ids, w_in, w_out, x)
    np.testing.assert_array_equal(np.asarray(fused(x, w, ids, w_in, w_out, x), np.float32),
                                  np.asarray(plain(x, w, ids, w_in, w_out, x), np.float32))
    stacks = [jnp.stack([a * 0.5, a]) for a in (w_in, w_out)]
    stacked = jax.jit(lambda x, wi, wo, i: jmp.moe_mlp(x, w, ids, wi, wo, layer=i, residual=x))
    assert FUSED_TARGET + "_stacked_residual" in lowered_text(stacked, x, *stacks, 1)
    np.testing.assert_array_equal(np.asarray(stacked(x, *stacks, 1), np.float32),
                                  np.asarray(plain(x, w, ids, w_in, w_out, x), np.float32))
