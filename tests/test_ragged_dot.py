"""jax_moe_permute.ragged_dot against jax.lax.ragged_dot in float32 with precision=HIGHEST:
forward, both gradients, second order, vmap, jit, shard_map (vma) and edge group sizes.

On CPU (and other GPUs than sm_90) this exercises the primitives' rules over the fallback
lowering; on an sm_90 GPU the bf16 / f16 cases run our CUTLASS kernels (test_kernels_used
checks that they do)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_moe_permute as jmp
from jax_moe_permute import gemm_primitives
from jax_moe_permute.grouped_gemm import DECODE_TILE, TILES, kernels_available

from conftest import fresh_key, needs_gpu, on_gpu, random_float

HIGHEST = jax.lax.Precision.HIGHEST
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Relative to the largest reference magnitude: the output is rounded to the input dtype.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1.6e-2, jnp.dtype(jnp.float16): 2e-3}


def ref_ragged_dot(lhs, rhs, sizes):
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, precision=HIGHEST)


def assert_matches(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    scale = max(float(np.abs(ref).max(initial=0.0)), 1.0)
    tol = TOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def random_sizes(G, M, empty_fraction=0.3):
    """Random group sizes summing to at most M, some groups empty."""
    k1, k2 = jax.random.split(fresh_key())
    w = jax.random.uniform(k1, (G,)) * (jax.random.uniform(k2, (G,)) > empty_fraction)
    sizes = np.floor(np.asarray(w) / max(float(w.sum()), 1e-6) * M).astype(np.int32)
    return jnp.asarray(sizes)


def edge_cases(M, G):
    """(name, group sizes) of the edges of the contract."""
    one = np.zeros(G, np.int32)
    one[G // 2] = M
    empty = np.zeros(G, np.int32)
    empty[::2] = M // max(1, (G + 1) // 2)
    short = np.full(G, M // (2 * G), np.int32)
    over = np.full(G, M // G + 3, np.int32)
    return [("random", random_sizes(G, M)), ("one_group", jnp.asarray(one)), ("empty_groups", jnp.asarray(empty)),
            ("sum_below_m", jnp.asarray(short)), ("sum_above_m", jnp.asarray(over)),
            ("all_empty", jnp.zeros(G, jnp.int32))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(6))
def test_forward_edges(dtype, case):
    M, K, N, G = 200, 64, 48, 5
    name, sizes = edge_cases(M, G)[case]
    lhs, rhs = random_float((M, K), dtype), random_float((G, K, N), dtype)
    out = jax.jit(jmp.ragged_dot)(lhs, rhs, sizes)
    assert out.dtype == jnp.dtype(dtype), name
    ref = ref_ragged_dot(lhs, rhs, sizes)
    assert_matches(out, ref, dtype)
    end = min(int(np.sum(np.asarray(sizes))), M)
    assert np.all(np.asarray(out[end:], np.float32) == 0), f"{name}: rows past the sum must be zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8, 8, 1), (0, 16, 8, 3), (37, 24, 40, 1), (64, 12, 20, 4), (50, 16, 13, 3),
                                   (3, 128, 64, 64)], ids=["m1", "m0", "g1", "k_not8", "n_not8", "decode"])
def test_forward_shapes(dtype, shape):
    M, K, N, G = shape
    lhs, rhs = random_float((M, K), dtype), random_float((G, K, N), dtype)
    sizes = random_sizes(G, M, empty_fraction=0.5 if G > 8 else 0.0)
    out = jmp.ragged_dot(lhs, rhs, sizes)
    assert out.shape == (M, N) and out.dtype == jnp.dtype(dtype)
    assert_matches(out, ref_ragged_dot(lhs, rhs, sizes), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_preferred_element_type_float32(dtype):
    M, K, N, G = 96, 32, 24, 4
    lhs, rhs, sizes = random_float((M, K), dtype), random_float((G, K, N), dtype), random_sizes(G, M)
    out = jmp.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_ragged_dot(lhs, rhs, sizes)), rtol=1e-4, atol=1e-3)


def test_mixed_dtypes_and_group_offset_go_to_lax():
    M, K, N, G = 40, 16, 8, 3
    lhs, rhs, sizes = random_float((M, K), jnp.bfloat16), random_float((G, K, N), jnp.float32), random_sizes(G, M)
    np.testing.assert_array_equal(np.asarray(jmp.ragged_dot(lhs, rhs, sizes)),
                                  np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)))


def grads_of(fn, lhs, rhs, sizes, cot):
    _, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return vjp(cot)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(6))
def test_gradients(dtype, case):
    M, K, N, G = 160, 32, 40, 6
    name, sizes = edge_cases(M, G)[case]
    lhs, rhs = random_float((M, K), dtype), random_float((G, K, N), dtype)
    cot = random_float((M, N), dtype)
    d_lhs, d_rhs = jax.jit(lambda a, b, c: grads_of(jmp.ragged_dot, a, b, sizes, c))(lhs, rhs, cot)
    assert d_lhs.dtype == jnp.dtype(dtype) and d_rhs.dtype == jnp.dtype(dtype)
    r_lhs, r_rhs = grads_of(ref_ragged_dot, lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                            cot.astype(jnp.float32))
    assert_matches(d_lhs, r_lhs, dtype)
    assert_matches(d_rhs, r_rhs, dtype)
    empty = np.asarray(sizes) == 0
    if name != "sum_above_m":
        assert np.all(np.asarray(d_rhs, np.float32)[empty] == 0), f"{name}: groups without rows get zero dW"
    end = min(int(np.sum(np.asarray(sizes))), M)
    assert np.all(np.asarray(d_lhs[end:], np.float32) == 0)


def test_check_grads_order2():
    """Finite differences (float32): on CPU and non-sm_90 GPUs through the fallback lowering,
    the rules are the same as on the kernels."""
    M, K, N, G = 24, 8, 16, 3
    lhs, rhs = random_float((M, K), jnp.float32), random_float((G, K, N), jnp.float32)
    sizes = jnp.array([7, 0, 12], jnp.int32)
    check_grads(lambda a, b: jmp.ragged_dot(a, b, sizes), (lhs, rhs), order=2, modes=("fwd", "rev"),
                atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_second_order_against_lax(dtype):
    """Hessian-vector products of a scalar loss: ours in `dtype`, lax in float32."""
    M, K, N, G = 96, 32, 24, 4
    lhs, rhs, sizes = random_float((M, K), dtype), random_float((G, K, N), dtype), random_sizes(G, M)
    t_lhs, t_rhs = random_float((M, K), dtype), random_float((G, K, N), dtype)

    def hvp(fn, args, tangents):
        loss = lambda a, b: jnp.sum(jnp.sin(fn(a, b, sizes).astype(jnp.float32)))
        return jax.jvp(jax.grad(loss, argnums=(0, 1)), args, tangents)[1]

    ours = jax.jit(lambda *x: hvp(jmp.ragged_dot, x[:2], x[2:]))(lhs, rhs, t_lhs, t_rhs)
    f32 = lambda x: x.astype(jnp.float32)
    ref = hvp(ref_ragged_dot, (f32(lhs), f32(rhs)), (f32(t_lhs), f32(t_rhs)))
    tol = 1e-4 if dtype == jnp.float32 else 6e-2  # bf16 rounds every intermediate
    for o, r in zip(ours, ref):
        scale = float(np.abs(np.asarray(r)).max())
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(r), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axes", [(0, None, None), (0, 0, 0), (None, 0, None), (1, None, 0)])
def test_vmap(dtype, axes):
    V, M, K, N, G = 3, 64, 16, 24, 4
    lhs = random_float((V, M, K) if axes[0] == 0 else (M, V, K) if axes[0] == 1 else (M, K), dtype)
    rhs = random_float((V, G, K, N) if axes[1] == 0 else (G, K, N), dtype)
    sizes = jnp.stack([random_sizes(G, M) for _ in range(V)]) if axes[2] == 0 else random_sizes(G, M)
    out = jax.jit(jax.vmap(jmp.ragged_dot, in_axes=axes))(lhs, rhs, sizes)
    take = lambda x, ax, v: x if ax is None else jnp.take(x, v, axis=ax)
    for v in range(V):
        ref = ref_ragged_dot(take(lhs, axes[0], v), take(rhs, axes[1], v), take(sizes, axes[2], v))
        assert_matches(out[v], ref, dtype)


def test_vmap_grad():
    V, M, K, N, G = 2, 48, 16, 8, 3
    lhs, rhs = random_float((V, M, K), jnp.float32), random_float((G, K, N), jnp.float32)
    sizes = random_sizes(G, M)
    ours = jax.grad(lambda a, b: jnp.sum(jax.vmap(jmp.ragged_dot, (0, None, None))(a, b, sizes) ** 2), (0, 1))(
        lhs, rhs)
    # lax.ragged_dot's own batching takes only operands batched along axis 0: loop for the reference.
    ref = jax.grad(lambda a, b: sum(jnp.sum(ref_ragged_dot(a[v], b, sizes) ** 2) for v in range(V)), (0, 1))(
        lhs, rhs)
    for o, r in zip(ours, ref):
        assert_matches(o, r, jnp.float32)


def test_one_launch_under_vmap():
    """vmap folds into the primitive's batch axis: one bind (one custom call on the kernels)."""
    lhs, rhs, sizes = random_float((4, 32, 16), jnp.bfloat16), random_float((3, 16, 8), jnp.bfloat16), \
        jnp.array([10, 0, 20], jnp.int32)
    jaxpr = jax.make_jaxpr(jax.vmap(jmp.ragged_dot, (0, None, None)))(lhs, rhs, sizes)
    assert str(jaxpr).count("jax_moe_permute_ragged_dot") == 1


def test_errors():
    lhs, rhs, sizes = jnp.zeros((8, 4)), jnp.zeros((2, 4, 8)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="lhs"):
        jmp.ragged_dot(lhs[None], rhs, sizes)
    with pytest.raises(ValueError, match="rhs"):
        jmp.ragged_dot(lhs, rhs[0], sizes)
    with pytest.raises(ValueError, match="disagree on K"):
        jmp.ragged_dot(lhs, jnp.zeros((2, 5, 8)), sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        jmp.ragged_dot(lhs, rhs, jnp.array([4, 2, 2], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes"):
        jmp.ragged_dot(lhs, rhs, jnp.array([4.0, 4.0]))


def test_weight_grad_kernel_variable(monkeypatch):
    """MOE_GROUPED_GEMM_DW_KERNEL names auto, cutlass or persistent, MOE_SM90_WGRAD_EPILOGUE one of
    DW_EPILOGUES; anything else is an error naming the variable; cutlass never takes our kernel,
    nor does a platform without it."""
    from jax_moe_permute import _native
    sizes = (1, 4096, 256, 512, 16)  # batch, rows, k, n, groups: 256 rows a group
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "fastest")
    with pytest.raises(ValueError, match="MOE_GROUPED_GEMM_DW_KERNEL"):
        gemm_primitives.use_own_wgrad_kernel(*sizes)
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "cutlass")
    assert not gemm_primitives.use_own_wgrad_kernel(*sizes)
    monkeypatch.delenv("MOE_GROUPED_GEMM_DW_KERNEL")
    assert gemm_primitives.use_own_wgrad_kernel(*sizes) == _native.has_target("cuda", "ragged_dot_wgrad_sm90")
    monkeypatch.setenv("MOE_SM90_WGRAD_EPILOGUE", "smem")  # the kernel's epilogue: checked as well
    with pytest.raises(ValueError, match="MOE_SM90_WGRAD_EPILOGUE"):
        gemm_primitives.use_own_wgrad_kernel(*sizes)
    for epilogue in gemm_primitives.DW_EPILOGUES:
        monkeypatch.setenv("MOE_SM90_WGRAD_EPILOGUE", epilogue)
        assert gemm_primitives.use_own_wgrad_kernel(*sizes) == _native.has_target("cuda", "ragged_dot_wgrad_sm90")


_SHARD_MAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    import jax_moe_permute as jmp
    mesh = jax.make_mesh((4,), ("x",))
    M, K, N, G = 32, 16, 8, 3
    lhs = jax.random.normal(jax.random.PRNGKey(0), (4 * M, K))
    rhs = jax.random.normal(jax.random.PRNGKey(1), (G, K, N))
    sizes = jnp.array([10, 0, 15], jnp.int32)  # replicated: lhs varies over x, rhs and sizes do not

    def local(fn):
        def body(a, b, s):
            out = fn(a, b, s)
            loss = lambda a, b: jnp.sum(fn(a, b, s) ** 2)
            da, db = jax.grad(loss, (0, 1))(a, b)
            return out, da, jax.lax.psum(db, "x")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()),
                                     out_specs=(P("x"), P("x"), P()), check_vma=True))

    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    lhs, rhs, sizes = put(lhs, P("x")), put(rhs, P()), put(sizes, P())
    ours = local(jmp.ragged_dot)(lhs, rhs, sizes)
    ref = local(lambda a, b, s: jax.lax.ragged_dot(a, b, s, precision=jax.lax.Precision.HIGHEST))(lhs, rhs, sizes)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-4)
    print("shard_map ok")
""")


def test_shard_map_check_vma():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", _SHARD_MAP_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)) + "/..")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "shard_map ok" in res.stdout


# ---- the kernels themselves (sm_90) ------------------------------------------------------

@needs_gpu
def test_kernels_used():
    """On an sm_90 GPU the bf16 path must be our custom calls, forward and backward."""
    if not kernels_available():
        pytest.fail(f"grouped GEMM kernels not available on {jax.devices()[0].device_kind}")
    lhs, rhs, sizes = random_float((64, 32), jnp.bfloat16), random_float((4, 32, 16), jnp.bfloat16), \
        jnp.array([10, 0, 30, 4], jnp.int32)
    def fwd_bwd(a, b):
        out, vjp = jax.vjp(lambda a, b: jmp.ragged_dot(a, b, sizes), a, b)
        return out, vjp(jnp.ones((64, 16), jnp.bfloat16))

    fwd_bwd = jax.jit(fwd_bwd)
    hlo = fwd_bwd.lower(lhs, rhs).as_text()
    assert hlo.count("@jax_moe_permute.ragged_dot(") == 2, hlo  # forward and d lhs
    assert hlo.count("@jax_moe_permute.ragged_dot_weight_grad(") == 1, hlo


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("G,M,K,N", [(8, 2048, 256, 512), (64, 1000, 128, 264), (256, 37, 64, 128)])
def test_kernels_larger(dtype, G, M, K, N):
    """Several tiles per group, partial tiles in every dimension, many small groups."""
    lhs, rhs, cot = random_float((M, K), dtype), random_float((G, K, N), dtype), random_float((M, N), dtype)
    sizes = random_sizes(G, M - 5)
    out, vjp = jax.vjp(lambda a, b: jmp.ragged_dot(a, b, sizes), lhs, rhs)
    d_lhs, d_rhs = vjp(cot)
    f32 = lambda x: x.astype(jnp.float32)
    ref, ref_vjp = jax.vjp(lambda a, b: ref_ragged_dot(a, b, sizes), f32(lhs), f32(rhs))
    r_lhs, r_rhs = ref_vjp(f32(cot))
    assert_matches(out, ref, dtype)
    assert_matches(d_lhs, r_lhs, dtype)
    assert_matches(d_rhs, r_rhs, dtype)
    assert np.all(np.asarray(out[int(sizes.sum()):], np.float32) == 0)


@needs_gpu
@pytest.mark.parametrize("tile", TILES)
def test_kernels_every_tile(tile, monkeypatch):
    """Each tile, forced (MOE_GROUPED_GEMM_TILE and MOE_GROUPED_GEMM_DW_TILE are read at every
    call), on the forward and d lhs, and on the weight gradient (empty groups included)."""
    G, M, K, N = 24, 700, 200, 328
    lhs, rhs, cot = (random_float(s, jnp.bfloat16) for s in ((M, K), (G, K, N), (M, N)))
    sizes = random_sizes(G, M - 9).at[3].set(0)
    f32 = lambda x: x.astype(jnp.float32)
    ref, ref_vjp = jax.vjp(lambda a, b: ref_ragged_dot(a, b, sizes), f32(lhs), f32(rhs))
    r_lhs, r_rhs = ref_vjp(f32(cot))
    for variable in ("MOE_GROUPED_GEMM_TILE", "MOE_GROUPED_GEMM_DW_TILE"):
        monkeypatch.setenv(variable, tile)
        out, vjp = jax.vjp(lambda a, b: jmp.ragged_dot(a, b, sizes), lhs, rhs)
        d_lhs, d_rhs = vjp(cot)
        assert_matches(out, ref, jnp.bfloat16)
        assert_matches(d_lhs, r_lhs, jnp.bfloat16)
        assert_matches(d_rhs, r_rhs, jnp.bfloat16)
        assert np.all(np.asarray(d_rhs[3], np.float32) == 0)
        monkeypatch.setenv(variable, "32x32")
        with pytest.raises(Exception, match=variable):
            jax.block_until_ready(jax.vjp(lambda a, b: jmp.ragged_dot(a, b, sizes), lhs, rhs)[1](cot))
        monkeypatch.delenv(variable)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("G,M,K,N", [(8, 2048, 256, 512), (64, 1000, 128, 320), (256, 37, 64, 128),
                                     (24, 700, 192, 64), (3, 300, 2048, 1536)])
def test_persistent_weight_grad_kernel(dtype, G, M, K, N, monkeypatch):
    """Our persistent weight-gradient kernel (MOE_GROUPED_GEMM_DW_KERNEL=persistent, read when the
    call is lowered) against the float32 reference on every edge of the group sizes (K and N not
    multiples of its 128 x 256 tile, a group's rows not a multiple of its 64-row stage), bitwise
    reproducible, and a NaN in one group's rows stays out of every other group's gradient."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "persistent")
    lhs, rhs, cot = random_float((M, K), dtype), random_float((G, K, N), dtype), random_float((M, N), dtype)
    f32 = lambda x: x.astype(jnp.float32)
    d_rhs_of = jax.jit(lambda a, c, sizes: jax.vjp(lambda b: jmp.ragged_dot(a, b, sizes), rhs)[1](c)[0])
    assert "@jax_moe_permute.ragged_dot_wgrad_sm90(" in d_rhs_of.lower(lhs, cot, random_sizes(G, M)).as_text()
    # A group's last stage with 1-16, 17-32, 33-48 and 49-64 rows: the kernel issues 1-4 of its 16-row steps.
    bands = np.resize(np.array([1, 16, 17, 32, 33, 48, 49, 63, 64, 65, 80, 129], np.int32), G)
    bands[np.cumsum(bands) > M] = 0
    for name, sizes in edge_cases(M, G) + [("stage_bands", jnp.asarray(bands))]:
        d_rhs = d_rhs_of(lhs, cot, sizes)
        r_rhs = jax.vjp(lambda b: ref_ragged_dot(f32(lhs), b, sizes), f32(rhs))[1](f32(cot))[0]
        assert d_rhs.dtype == jnp.dtype(dtype)
        assert_matches(d_rhs, r_rhs, dtype)
        if name != "sum_above_m":
            assert np.all(np.asarray(d_rhs, np.float32)[np.asarray(sizes) == 0] == 0), name
        np.testing.assert_array_equal(np.asarray(d_rhs_of(lhs, cot, sizes), np.float32), np.asarray(d_rhs, np.float32))
    sizes = np.full(G, M // G, np.int32)
    if G > 1 and sizes[0] > 1:
        poisoned = cot.at[sizes[0]].set(jnp.nan)  # the first row of group 1
        d_rhs = np.asarray(d_rhs_of(lhs, poisoned, jnp.asarray(sizes)), np.float32)
        assert np.isnan(d_rhs[1]).any() and np.isfinite(np.delete(d_rhs, 1, axis=0)).all()


@needs_gpu
@pytest.mark.parametrize("epilogue", [e for e in gemm_primitives.DW_EPILOGUES if e != "registers"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_persistent_weight_grad_epilogues(dtype, epilogue, monkeypatch):
    """Each other epilogue of the persistent dW kernel (MOE_SM90_WGRAD_EPILOGUE, read at every
    launch; the default: one box at a time through shared memory, stored by TMA) writes bitwise
    what the register epilogue writes, on every edge of the group sizes, including K and N not
    multiples of its tile and groups without rows (their zero tiles)."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "persistent")
    for G, M, K, N in ((8, 2048, 256, 512), (24, 700, 192, 64), (3, 300, 2048, 1536)):
        lhs, rhs, cot = random_float((M, K), dtype), random_float((G, K, N), dtype), random_float((M, N), dtype)
        d_rhs_of = jax.jit(lambda a, c, sizes: jax.vjp(lambda b: jmp.ragged_dot(a, b, sizes), rhs)[1](c)[0])
        for name, sizes in edge_cases(M, G):
            monkeypatch.setenv("MOE_SM90_WGRAD_EPILOGUE", "registers")
            want = np.asarray(d_rhs_of(lhs, cot, sizes), np.float32)
            monkeypatch.setenv("MOE_SM90_WGRAD_EPILOGUE", epilogue)
            got = np.asarray(d_rhs_of(lhs, cot, sizes), np.float32)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} G={G} M={M} K={K} N={N}")
        r_rhs = jax.vjp(lambda b: ref_ragged_dot(lhs.astype(jnp.float32), b, sizes),
                        rhs.astype(jnp.float32))[1](cot.astype(jnp.float32))[0]
        assert_matches(got, r_rhs, dtype)


def test_weight_grad_kernel_choice(monkeypatch):
    """By default dW takes our persistent kernel where it fits and groups average fewer than 1024
    rows, CUTLASS's for longer groups, for K or N not a multiple of 64, and wherever
    MOE_GROUPED_GEMM_DW_KERNEL=cutlass or a forced CUTLASS tile (MOE_GROUPED_GEMM_DW_TILE) says so.
    The choice is made when the call is lowered, so it is checked by lowering for an sm_90 GPU
    (jax.export), which needs the CUDA module but no GPU."""
    from jax import export
    from jax_moe_permute import _native
    if not _native.has_target("cuda", "ragged_dot_wgrad_sm90"):
        pytest.skip("the CUDA module with the sm_90 GEMM kernels is not built")
    monkeypatch.setattr(gemm_primitives, "gpu_is_sm90", lambda: True)
    monkeypatch.delenv("MOE_GROUPED_GEMM_DW_KERNEL", raising=False)
    monkeypatch.delenv("MOE_GROUPED_GEMM_DW_TILE", raising=False)
    ours, cutlass = "jax_moe_permute.ragged_dot_wgrad_sm90", "jax_moe_permute.ragged_dot_weight_grad"
    unchecked = [export.DisabledSafetyCheck.custom_call(t) for t in (ours, cutlass)]

    def kernel(G, M, K, N):
        lhs, cot, rhs = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, K), (M, N), (G, K, N)))
        sizes = jax.ShapeDtypeStruct((G,), jnp.int32)
        d_rhs = jax.jit(lambda a, b, c, s: jax.vjp(lambda b: jmp.ragged_dot(a, b, s), b)[1](c)[0])
        text = export.export(d_rhs, platforms=["cuda"], disabled_checks=unchecked)(lhs, rhs, cot, sizes).mlir_module()
        assert (ours in text) != (cutlass in text), text
        return "persistent" if ours in text else "cutlass"

    assert kernel(16, 16 * 256, 256, 512) == "persistent"
    assert kernel(16, 16 * 1024, 256, 512) == "cutlass"  # long groups
    assert kernel(16, 16 * 256, 200, 512) == "cutlass"  # K not a multiple of 64
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_TILE", "128x256")
    assert kernel(16, 16 * 256, 256, 512) == "cutlass"
    monkeypatch.delenv("MOE_GROUPED_GEMM_DW_TILE")
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "cutlass")
    assert kernel(16, 16 * 256, 256, 512) == "cutlass"
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "persistent")
    assert kernel(16, 16 * 1024, 256, 512) == "persistent"


@needs_gpu
def test_kernels_run_order(monkeypatch):
    """The run tile order (MOE_GROUPED_GEMM_RUN / MOE_GROUPED_GEMM_DW_RUN, read at every call) on
    the 128 x 256 tile: the same tiles in another order, so bitwise CUTLASS's strided order (run
    1), with complete rounds and a strided tail (run 2, 3), runs longer than a group's tiles (5, 16),
    and a run whose first round is already incomplete (64). Empty groups in the middle."""
    G, M, K, N = 40, 12000, 512, 1024
    lhs, rhs, cot = (random_float(s, jnp.bfloat16) for s in ((M, K), (G, K, N), (M, N)))
    sizes = random_sizes(G, M - 7).at[5].set(0).at[6].set(0)
    monkeypatch.setenv("MOE_GROUPED_GEMM_TILE", "128x256")
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_TILE", "128x256")

    def grads():
        out, vjp = jax.vjp(lambda a, b: jmp.ragged_dot(a, b, sizes), lhs, rhs)
        return [np.asarray(v.astype(jnp.float32)) for v in (out, *vjp(cot))]

    first = grads()
    f32 = lambda x: x.astype(jnp.float32)
    ref, ref_vjp = jax.vjp(lambda a, b: ref_ragged_dot(a, b, sizes), f32(lhs), f32(rhs))
    for got, want in zip(first, (ref, *ref_vjp(f32(cot)))):
        assert_matches(got, want, jnp.bfloat16)
    for run in ("2", "3", "5", "16", "64"):
        monkeypatch.setenv("MOE_GROUPED_GEMM_RUN", run)
        monkeypatch.setenv("MOE_GROUPED_GEMM_DW_RUN", run)
        for name, got, want in zip(("out", "d_lhs", "d_rhs"), grads(), first):
            np.testing.assert_array_equal(got, want, err_msg=f"{name}, run {run}")


# (G, M, K, N, sizes): one row per group, several passes of 8 rows with every remainder (1, 2,
# 3-4, 5-8 rows), K over one staged chunk and not a multiple of the 32 rows a block step reads,
# partial column strips, rows past the sum, all groups empty, more than 256 groups (the slot scan
# runs in chunks), a single group holding every row.
DECODE_CASES = [
    (16, 8, 256, 192, [1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]),
    (5, 120, 520, 72, [33, 0, 17, 26, 44]),
    (3, 30, 1096, 40, [9, 12, 2]),
    (4, 50, 64, 136, [3, 0, 5, 0]),
    (6, 12, 40, 8, [0, 0, 0, 0, 0, 0]),
    (300, 40, 32, 24, None),
    (1, 64, 2048, 256, [64]),
]


def fwd_and_grads(sizes):
    """A freshly traced jitted (out, d lhs, d rhs) of ragged_dot: MOE_GROUPED_GEMM_TILE=decode is
    read when a call is lowered."""
    def run(a, b, ct):
        out, vjp = jax.vjp(lambda a, b: jmp.ragged_dot(a, b, sizes), a, b)
        return (out, *vjp(ct))
    return jax.jit(run)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("G,M,K,N,sizes", DECODE_CASES)
def test_decode_kernel(dtype, G, M, K, N, sizes, monkeypatch):
    """The forward GEMM's decode kernel, forced, against the float32 reference; d lhs and d rhs
    of the same call keep their own kernels."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_TILE", DECODE_TILE)
    lhs, rhs, cot = random_float((M, K), dtype), random_float((G, K, N), dtype), random_float((M, N), dtype)
    sizes = random_sizes(G, M) if sizes is None else jnp.asarray(sizes, jnp.int32)
    call = fwd_and_grads(sizes)
    assert "@jax_moe_permute.ragged_dot_decode(" in call.lower(lhs, rhs, cot).as_text()
    out, d_lhs, d_rhs = call(lhs, rhs, cot)
    f32 = lambda x: x.astype(jnp.float32)
    ref, ref_vjp = jax.vjp(lambda a, b: ref_ragged_dot(a, b, sizes), f32(lhs), f32(rhs))
    r_lhs, r_rhs = ref_vjp(f32(cot))
    assert_matches(out, ref, dtype)
    assert_matches(d_lhs, r_lhs, dtype)
    assert_matches(d_rhs, r_rhs, dtype)
    assert np.all(np.asarray(out[int(sizes.sum()):], np.float32) == 0)


@needs_gpu
def test_decode_kernel_vmap_and_default_choice(monkeypatch):
    """A vmapped decode call (batched sizes, shared rhs: batch strides 0) chosen by the default
    rule, equal to a CUTLASS tile's result to rounding; dW has no decode kernel."""
    V, M, K, N, G = 3, 6, 1024, 320, 32
    lhs, rhs = random_float((V, M, K), jnp.bfloat16), random_float((G, K, N), jnp.bfloat16)
    sizes = jnp.stack([random_sizes(G, M) for _ in range(V)])
    call = lambda: jax.jit(jax.vmap(lambda a, b, s: jmp.ragged_dot(a, b, s), (0, None, 0)))
    decode = call()
    assert "@jax_moe_permute.ragged_dot_decode(" in decode.lower(lhs, rhs, sizes).as_text()
    out = decode(lhs, rhs, sizes)
    monkeypatch.setenv("MOE_GROUPED_GEMM_TILE", "64x256")
    tiled = call()
    assert "@jax_moe_permute.ragged_dot_decode(" not in tiled.lower(lhs, rhs, sizes).as_text()
    tiled = tiled(lhs, rhs, sizes)
    for v in range(V):
        assert_matches(out[v], ref_ragged_dot(lhs[v], rhs, sizes[v]), jnp.bfloat16)
        assert_matches(out[v], tiled[v], jnp.bfloat16)
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_TILE", DECODE_TILE)
    with pytest.raises(Exception, match="MOE_GROUPED_GEMM_DW_TILE"):
        jax.block_until_ready(jax.grad(lambda b: jnp.sum(jmp.ragged_dot(lhs[0], b, sizes[0]).astype(jnp.float32)))(rhs))


@needs_gpu
def test_kernels_vmap_broadcast_rhs():
    """A vmapped batch with a shared rhs: batch stride 0 for rhs in the kernel."""
    V, M, K, N, G = 3, 300, 64, 128, 5
    lhs, rhs = random_float((V, M, K), jnp.bfloat16), random_float((G, K, N), jnp.bfloat16)
    sizes = jnp.stack([random_sizes(G, M) for _ in range(V)])
    out = jax.jit(jax.vmap(jmp.ragged_dot, (0, None, 0)))(lhs, rhs, sizes)
    for v in range(V):
        assert_matches(out[v], ref_ragged_dot(lhs[v], rhs, sizes[v]), jnp.bfloat16)


def test_fallback_reason_documented():
    """CPU and other platforms: the primitives lower to jax.lax.ragged_dot (kernels report so)."""
    if not on_gpu():
        assert not kernels_available()


def test_bench_gemm_smoke(tmp_path):
    """The benchmark runs end to end (tiny problem; on CPU through the fallback)."""
    from jax_moe_permute import bench

    out = tmp_path / "g.json"
    assert bench.main(["--ops", "ragged_dot,ragged_dot_bwd", "--problems", "tiny", "--groups", "uniform,decode1",
                       "--iterations", "2", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())
    assert len(rows) == 4 and all(r["us"] and r["lax_us"] and r["dense_us"] for r in rows)


def test_bench_gemm_times_tokamax_where_installed(tmp_path, monkeypatch):
    """A third implementation (tokamax where installed; a stand-in here) gets its own column, and
    --no-lax leaves lax.ragged_dot out."""
    import json

    from jax_moe_permute import bench, bench_gemm

    monkeypatch.setattr(bench_gemm, "tokamax_ragged_dot", lambda: jax.lax.ragged_dot)
    out = tmp_path / "g.json"
    assert bench.main(["--ops", "ragged_dot,ragged_dot_bwd", "--problems", "tiny", "--groups", "uniform",
                       "--iterations", "2", "--no-lax", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["tokamax_us"] > 0 and r["lax_us"] is None for r in rows)
    assert bench_gemm.format_row(rows[0]).split()[-1] == f"{rows[0]['tokamax_us'] / rows[0]['us']:.2f}"


def test_bench_gemm_group_sizes():
    """The benchmark's group-size kinds: the same total rows uniform and skewed (some experts
    empty); T tokens routed top-k to distinct experts at any T."""
    from jax_moe_permute.bench_gemm import group_sizes

    uniform, skewed = group_sizes("uniform", 16, 2, 64), group_sizes("skewed", 16, 2, 64)
    assert uniform.sum() == skewed.sum() == 16 * 64 and (skewed == 0).sum() == 2
    for kind, T in (("decode1", 1), ("decode64", 64), ("routed4096", 4096)):
        sizes = group_sizes(kind, 16, 2, 64)
        assert sizes.shape == (16,) and sizes.sum() == 2 * T and sizes.max() <= T
