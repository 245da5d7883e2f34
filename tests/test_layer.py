"""moe_mlp against a dense einsum reference (every expert on every token, gates from the same
routing), forward and gradients, every activation, expert_map, bf16, jit / vmap, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute.layer import reference_moe_mlp
from conftest import random_float

HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames="activation")  # one compile per shape, not one per eager op
def dense_moe(x, weights, ids, w_in, w_out, activation="swiglu", expert_ids=None):
    """out[t] = sum_e gate[t,e] * MLP_e(x[t]) with every expert computed; gate[t,e] sums the
    weights of the slots of t that chose e (ids outside the experts contribute nothing).
    expert_ids: the global id of each row of w_in / w_out (default: its index)."""
    E = w_in.shape[0]
    expert_ids = jnp.arange(E) if expert_ids is None else expert_ids
    gates = jnp.einsum("tk,tke->te", weights.astype(jnp.float32),
                       (ids[..., None] == expert_ids[None, None]).astype(jnp.float32))
    h = jnp.einsum("th,ehf->etf", x, w_in, precision=HIGHEST)
    if activation in ("swiglu", "geglu"):
        gate, up = jnp.split(h, 2, axis=-1)
        a = (jax.nn.silu(gate) if activation == "swiglu" else jax.nn.gelu(gate, approximate=False)) * up
    else:
        a = jax.nn.relu(h) if activation == "relu" else jax.nn.gelu(h, approximate=False)
    y = jnp.einsum("etf,efh->eth", a, w_out, precision=HIGHEST)
    return jnp.einsum("te,eth->th", gates, y.astype(jnp.float32), precision=HIGHEST).astype(x.dtype)


def layer_inputs(T, E, K, H, F, activation="swiglu", dtype=jnp.float32):
    width = 2 * F if activation in ("swiglu", "geglu") else F
    r = jax.jit(jmp.route, static_argnums=1)(random_float((T, E), jnp.float32, 2.0), K)
    return (random_float((T, H), dtype), r.weights, r.ids, random_float((E, H, width), dtype, 0.5),
            random_float((E, F, H), dtype, 0.5))


def assert_allclose(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


# MOE_DOWN_BACKWARD: the backward of the layer's second half as the plain tangent's transpose, or
# as down_backward.py's primitive (one pass after the d lhs GEMM), plain or gathered (from the
# output's cotangent read through the row index: the GPU default for fine-grained experts, whose
# composition the CPU runs only when forced).
DOWN_BACKWARD = ["composition", "fused", "gathered"]


@pytest.fixture(params=DOWN_BACKWARD)
def down_backward(request, monkeypatch):
    monkeypatch.setenv("MOE_DOWN_BACKWARD", request.param)
    return request.param


@pytest.mark.parametrize("activation,T,E,K,H,F", [
    ("swiglu", 13, 8, 2, 16, 24), ("swiglu", 1, 4, 4, 1, 3), ("swiglu", 7, 1, 1, 5, 2), ("swiglu", 0, 4, 2, 8, 8),
    ("geglu", 10, 4, 2, 8, 6), ("gelu", 9, 5, 3, 7, 4), ("relu", 12, 6, 2, 8, 5)])
def test_forward_and_grads_match_dense(activation, T, E, K, H, F, down_backward):
    args = layer_inputs(T, E, K, H, F, activation)
    ours = jax.jit(functools.partial(jmp.moe_mlp, activation=activation))
    ref = functools.partial(dense_moe, activation=activation)
    assert_allclose(ours(*args), ref(*args))
    ct = random_float((T, H), jnp.float32)
    loss = lambda f: lambda x, w, wi, wo: jnp.sum(f(x, w, args[2], wi, wo) * ct)
    argnums = (0, 1, 2, 3)
    g = jax.jit(jax.grad(loss(ours), argnums))(*args[:2], *args[3:])
    g_ref = jax.jit(jax.grad(loss(ref), argnums))(*args[:2], *args[3:])
    for a, b in zip(g, g_ref):
        assert_allclose(a, b, 1e-4)


# Which inputs carry a tangent: each alone (the JVP rule's symbolic zeros) and all together.
TANGENT_SETS = [(0,), (1,), (3,), (4,), (0, 1, 3, 4)]


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("varying", TANGENT_SETS)
def test_forward_mode_matches_dense(activation, varying, down_backward):
    """jax.jvp with any subset of x, weights, w_in, w_out varying, invalid and repeated ids."""
    args = list(layer_inputs(11, 6, 3, 8, 5, activation))
    args[2] = jax.random.randint(jax.random.PRNGKey(3), (11, 3), -1, 7)
    tangents = {i: random_float(args[i].shape, jnp.float32) for i in varying}

    def jvp(f):
        def of_varying(*v):
            full = list(args)
            for i, a in zip(varying, v):
                full[i] = a
            return f(*full)
        return jax.jit(lambda: jax.jvp(of_varying, [args[i] for i in varying], [tangents[i] for i in varying]))()

    (out, dout), (ref, dref) = (jvp(functools.partial(f, activation=activation)) for f in (jmp.moe_mlp, dense_moe))
    assert_allclose(out, ref)
    assert_allclose(dout, dref, 1e-4)


def test_second_order_matches_dense(down_backward):
    """Reverse over reverse and forward over reverse (a Hessian-vector product) through the JVP rule."""
    args = layer_inputs(9, 4, 2, 6, 5)
    ct = random_float((9, 6), jnp.float32)
    v = [random_float(a.shape, jnp.float32) for a in (args[0], args[1], args[3], args[4])]

    def hvp(f):
        loss = lambda x, w, wi, wo: jnp.sum(jnp.tanh(f(x, w, args[2], wi, wo)) * ct)
        grad = jax.grad(loss, (0, 1, 2, 3))
        primals = (args[0], args[1], args[3], args[4])
        g2 = jax.grad(lambda *p: sum(jnp.sum(g * g) for g in grad(*p)), (0, 3))(*primals)
        return jax.jvp(grad, primals, tuple(v))[1], g2

    ours, ref = jax.jit(lambda: hvp(jmp.moe_mlp))(), jax.jit(lambda: hvp(dense_moe))()
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
        scale = float(jnp.abs(b).max())  # second derivatives reach ~1e2: compare relative to each leaf's size
        assert_allclose(a / scale, b / scale, 2e-4)


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_saved_residuals_at_most_a_dense_mlp(model, down_backward):
    """The backward keeps x, the routing and the first GEMM's output only: no more per token than
    a dense SwiGLU MLP of the same active width (counted from shapes: nothing runs)."""
    from jax_moe_permute import bench_memory

    E, K, H, F = bench_memory.MODELS[model]
    ours = bench_memory.saved_bytes_per_token("ours", model)
    assert ours <= bench_memory.saved_bytes_per_token("dense", model)
    # x and the gate|up product in bf16; the routing's float32 [E] probabilities and a few [K]
    # ids, weights and rows
    assert ours <= 2 * H + 2 * K * 2 * F + 4 * E + 8 * 4 * K + 64


def test_grads_of_vmapped_layers(down_backward):
    """vmap of jax.grad over a stack of layers, each with its own weights and tokens."""
    B, T, E, K, H, F = 2, 7, 4, 2, 8, 6
    x, ct = random_float((B, T, H), jnp.float32), random_float((B, T, H), jnp.float32)
    r = jax.jit(jax.vmap(lambda z: jmp.route(z, K)))(random_float((B, T, E), jnp.float32))
    w_in, w_out = random_float((B, E, H, 2 * F), jnp.float32), random_float((B, E, F, H), jnp.float32)
    loss = lambda f: lambda x, w, ids, wi, wo, c: jnp.sum(f(x, w, ids, wi, wo) * c)
    grads = lambda f: jax.vmap(jax.grad(loss(f), (0, 1, 3, 4)))(x, r.weights, r.ids, w_in, w_out, ct)
    for a, b in zip(jax.jit(lambda: grads(jmp.moe_mlp))(), jax.jit(lambda: grads(dense_moe))()):
        assert_allclose(a, b, 1e-4)


def test_invalid_ids_and_duplicates():
    x, w, _, w_in, w_out = layer_inputs(9, 6, 3, 8, 4)
    ids = jax.random.randint(jax.random.PRNGKey(7), (9, 3), -2, 8)  # -2..7: invalid and repeated ids
    assert_allclose(jax.jit(jmp.moe_mlp)(x, w, ids, w_in, w_out), dense_moe(x, w, ids, w_in, w_out))


def test_expert_map():
    """The local share of the experts (as under expert parallelism) gives the dense sum over them."""
    T, E, K, L = 11, 8, 2, 3
    x, w, ids, w_in, w_out = layer_inputs(T, E, K, 8, 4)
    local = jnp.array([5, 0, 2])  # global id of each local expert
    expert_map = jnp.full(E, -1, jnp.int32).at[local].set(jnp.arange(L))
    f = jax.jit(lambda *a: jmp.moe_mlp(*a, expert_map=expert_map, num_local_experts=L))
    out = f(x, w, ids, w_in[local], w_out[local])
    assert_allclose(out, dense_moe(x, w, ids, w_in[local], w_out[local], expert_ids=local))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(dtype):
    args = layer_inputs(33, 8, 2, 32, 48, dtype=dtype)
    out = jax.jit(jmp.moe_mlp)(*args)
    assert out.dtype == dtype
    ref = dense_moe(*[a.astype(jnp.float32) if a.dtype == dtype else a for a in args])
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2 * scale, rtol=3e-2)
    g = jax.jit(jax.grad(lambda x: jmp.moe_mlp(x, *args[1:]).astype(jnp.float32).sum()))(args[0])
    assert g.dtype == dtype and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_router_logits(dtype):
    """float32 logits from a product in x's dtype (float32: at full precision), and gradients back
    in each operand's dtype."""
    from jax_moe_permute.layer import router_logits
    x, router = random_float((37, 24), dtype), random_float((24, 5), jnp.float32)
    logits = jax.jit(router_logits)(x, router)
    assert logits.dtype == jnp.float32
    ref = jnp.dot(x.astype(jnp.float32), router.astype(dtype).astype(jnp.float32), precision=HIGHEST)
    assert_allclose(logits, ref, 1e-5 if dtype == jnp.float32 else 1e-2)
    gx, gr = jax.jit(jax.grad(lambda a, b: jnp.sum(router_logits(a, b) ** 2), (0, 1)))(x, router)
    assert (gx.dtype, gr.dtype) == (jnp.dtype(dtype), jnp.dtype(jnp.float32))
    if dtype == jnp.float32:
        assert_allclose(gr, 2 * jnp.dot(x.T, ref, precision=HIGHEST), 1e-4)


def test_vmap_and_reference_layer():
    """vmap over every argument: a stack of layers (jax.lax.ragged_dot's batching rule needs the
    expert weights batched too; to share weights, flatten the tokens instead)."""
    B, T, E, K, H, F = 3, 6, 4, 2, 8, 8
    x = random_float((B, T, H), jnp.float32)
    r = jax.jit(jax.vmap(lambda z: jmp.route(z, K)))(random_float((B, T, E), jnp.float32))
    w_in, w_out = random_float((B, E, H, 2 * F), jnp.float32), random_float((B, E, F, H), jnp.float32)
    args = (x, r.weights, r.ids, w_in, w_out)
    out = jax.jit(jax.vmap(jmp.moe_mlp))(*args)
    assert_allclose(out, jax.vmap(dense_moe)(*args))
    assert_allclose(jax.jit(jax.vmap(reference_moe_mlp))(*args), out)


def test_bad_arguments():
    x, w, ids, w_in, w_out = layer_inputs(4, 4, 2, 8, 6)
    with pytest.raises(ValueError, match="w_in"):
        jmp.moe_mlp(x, w, ids, w_in[:, :, :6], w_out)
    with pytest.raises(ValueError, match="w_in"):
        jmp.moe_mlp(x, w, ids, w_in, w_out, activation="relu")  # relu wants [E, H, F]
    with pytest.raises(ValueError, match="w_in"):
        jmp.moe_mlp(x[:, :5], w, ids, w_in, w_out)
    with pytest.raises(ValueError, match="activation"):
        jmp.moe_mlp(x, w, ids, w_in, w_out, activation="tanh")
    with pytest.raises(ValueError, match="weights"):
        jmp.moe_mlp(x, w[:3], ids, w_in, w_out)
    with pytest.raises(ValueError, match="num_local_experts"):
        jmp.moe_mlp(x, w, ids, w_in, w_out, expert_map=jnp.zeros(8, jnp.int32))
    with pytest.raises(ValueError, match="x"):
        jmp.moe_mlp(x[0], w, ids, w_in, w_out)
    with pytest.raises(TypeError, match="moe_mlp: x has dtype int32"):
        jmp.moe_mlp(x.astype(jnp.int32), w, ids, w_in, w_out)
    with pytest.raises(TypeError, match="moe_mlp: weights has dtype int32"):
        jmp.moe_mlp(x, w.astype(jnp.int32), ids, w_in, w_out)
    with pytest.raises(TypeError, match="moe_mlp: ids must have an integer dtype"):
        jmp.moe_mlp(x, w, ids.astype(jnp.float32), w_in, w_out)


def test_package_import_leaves_flax_out():
    import subprocess
    import sys

    code = "import sys, jax_moe_permute; assert 'flax' not in sys.modules and 'optax' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=__file__.rsplit("/tests/", 1)[0])
    assert proc.returncode == 0, proc.stderr[-2000:]

