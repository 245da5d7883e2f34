"""The backward of the layer's second half (jax_moe_permute/down_backward.py): the tangent's
primitive against the plain tangent (value, transpose, vmap, derivatives of the backward) on every
backend; on the GPU the d lhs GEMM with the activation's backward in its epilogue
(cpp/gemm/down_backward.cu) against the float32 `precision=HIGHEST` reference: every activation and
dtype, with and without gates, groups empty / one row / around the 128-row tile, rows past the
groups' sum, F around the 256-column tile, the K tail of H, bitwise reproducible; and the layer's
gradients with MOE_DOWN_BACKWARD=fused against the default to rounding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute import down_backward, gather_gemm, layer
from conftest import needs_gpu, random_float
from test_layer import assert_allclose, dense_moe, layer_inputs

ACTIVATIONS = ["swiglu", "geglu", "gelu", "relu"]
GATED = {"swiglu": True, "geglu": True, "gelu": False, "relu": False}


# (gates, which tangents are live: gate_up, the gates, w_out); without gates there is no gates' tangent.
DOWN_CASES = {"all": (True, (True, True, True)), "gate_up": (True, (True, False, False)),
              "gates": (True, (False, True, False)), "w_out": (True, (False, False, True)),
              "ungated_all": (False, (True, False, True)), "ungated_w_out": (False, (False, False, True))}


@pytest.mark.parametrize("case", DOWN_CASES)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_down_backward_primitive(case, activation):
    """down_backward's primitive: its value is the plain tangent's, its transpose (the backward in
    one pass: d gate_up, the gates' gradient, w_out's through w * h) the plain tangent's transpose,
    with empty groups and rows past the groups' sum; under vmap and differentiated again it runs
    the composition."""
    R, G, H, F = 23, 4, 8, 5
    width = 2 * F if activation == "swiglu" else F
    sizes = jnp.array([6, 0, 9, 5], jnp.int32)  # 20 of 23 rows
    gate_up, w_out = random_float((R, width), jnp.float32), random_float((G, F, H), jnp.float32)
    weighted, live = DOWN_CASES[case]
    w = random_float((R, 1), jnp.float32) if weighted else None
    shapes = [(R, width), (R, 1), (G, F, H)]
    tangents = [random_float(shape, jnp.float32) if on else None for shape, on in zip(shapes, live)]
    params = dict(activation=activation, live=live, weighted=weighted)
    placeholder = lambda a, ndim: jnp.zeros((1,) * ndim) if a is None else a

    def ours(gate_up, *t):
        d = iter(t)
        d = [next(d) if on else None for on in live]
        return down_backward.down_tangent(activation, sizes, w_out, gate_up, d[0], d[2], w, d[1])

    def plain(gate_up, *t):
        d = iter(t)
        d = [next(d) if on else placeholder(None, n) for on, n in zip(live, (2, 2, 3))]
        return down_backward._rows_tangent(d[0], d[1], d[2], gate_up, placeholder(w, 2), w_out, sizes, **params)

    args = [t for t in tangents if t is not None]
    assert_allclose(jax.jit(ours)(gate_up, *args), jax.jit(plain)(gate_up, *args))
    ct = random_float((R, H), jnp.float32)
    backward = lambda f, gu, c: jax.linear_transpose(functools.partial(f, gu), *args)(c)
    for a, b in zip(jax.jit(functools.partial(backward, ours))(gate_up, ct),
                    jax.jit(functools.partial(backward, plain))(gate_up, ct)):
        assert_allclose(a, b, 1e-4)
    batched = [jnp.stack([a, 2 * a]) for a in args]
    vmapped = lambda f: jax.jit(jax.vmap(f, in_axes=(None,) + (0,) * len(args)))(gate_up, *batched)
    assert_allclose(vmapped(ours), vmapped(plain))
    # The backward vmapped over cotangents, and differentiated again along the cotangent alone (the
    # backward's primitive's rules) and along gate_up too (the tangent's): each the composition.
    cts = jnp.stack([ct, -ct])
    for a, b in zip(*(jax.jit(jax.vmap(functools.partial(backward, f, gate_up)))(cts) for f in (ours, plain))):
        assert_allclose(a, b, 1e-4)
    d_gu = random_float(gate_up.shape, jnp.float32)
    for primals, tangents in (((gate_up, ct), (jnp.zeros_like(gate_up), 2 * ct)), ((gate_up, ct), (d_gu, 2 * ct))):
        again = lambda f: jax.jvp(functools.partial(backward, f), primals, tangents)[1]
        for a, b in zip(jax.jit(lambda: again(ours))(), jax.jit(lambda: again(plain))()):
            assert_allclose(a, b, 1e-4)


def vjp_reference(ct, gate_up, w, w_out, sizes, activation):
    """down_vjp_p's results in float32, precision HIGHEST, each row's expert by an explicit group id;
    rows past the groups' sum are zeros."""
    ct32, gate_up32, w_out32 = (a.astype(jnp.float32) for a in (ct, gate_up, w_out))
    sizes = np.clip(np.asarray(sizes), 0, None)
    R = ct.shape[0]
    group = np.repeat(np.arange(len(sizes)), sizes)[:R]
    live = np.zeros((R, 1), bool)
    live[:len(group)] = True
    group = np.concatenate([group, np.zeros(R - len(group), int)])
    g = jnp.einsum("rh,rfh->rf", ct32, w_out32[group], precision=jax.lax.Precision.HIGHEST)
    g = jnp.where(live, g, 0.0)
    h, act_vjp = jax.vjp(lambda a: layer.apply_activation(a, activation), gate_up32)
    w = jnp.ones((R, 1), jnp.float32) if w is None else w
    d_gate_up = act_vjp(w * g)[0]
    return d_gate_up, jnp.sum(g * h, axis=-1, keepdims=True), jnp.where(live, w * h, 0.0)


def vjp_call(ct, gate_up, w, w_out, sizes, activation):
    weighted = w is not None
    w = jnp.zeros((1, 1), jnp.float32) if w is None else w
    return down_backward.down_vjp(ct, gate_up, w, w_out, sizes, activation=activation, weighted=weighted)


def vjp_problem(dtype, activation, weighted, H=200, F=320, sizes=None):
    """H: the K tail (200 = 3 x 64 + 8); F: a 256-column tile and a 64-column one; groups empty,
    of one row and around the 128-row tile; 5 rows past the groups' sum."""
    sizes = np.array([0, 1, 64, 65, 0, 128, 129, 200, 3], np.int32) if sizes is None else sizes
    R = int(sizes.sum()) + 5
    width = 2 * F if GATED[activation] else F
    ct, gate_up = random_float((R, H), dtype), random_float((R, width), dtype, 2.0)
    w_out = random_float((len(sizes), F, H), dtype, 1.0 / np.sqrt(H))
    w = random_float((R, 1), jnp.float32) if weighted else None
    return ct, gate_up, w, w_out, sizes


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("weighted", [True, False])
def test_down_vjp_composition(activation, weighted):
    """down_vjp_p's composition (every backend but the kernel's) against the float32 reference."""
    ct, gate_up, w, w_out, sizes = vjp_problem(jnp.float32, activation, weighted, H=24, F=40)
    got = jax.jit(functools.partial(vjp_call, activation=activation))(ct, gate_up, w, w_out, jnp.asarray(sizes))
    for a, b in zip(got, vjp_reference(ct, gate_up, w, w_out, sizes, activation)):
        assert_allclose(a, b, 1e-4)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("weighted", [True, False])
def test_down_backward_kernel(dtype, activation, weighted):
    check_kernel(vjp_problem(dtype, activation, weighted), activation)


@needs_gpu
def test_down_backward_kernel_many_tiles():
    """More tiles than SMs (two column tiles of F = 320 over about 180 row tiles): each block runs
    several, so the stage ring goes through many phases and tiles of different experts."""
    sizes = np.random.default_rng(3).integers(0, 1500, 24).astype(np.int32)
    sizes[[2, 9]] = 0
    check_kernel(vjp_problem(jnp.bfloat16, "swiglu", True, H=72, sizes=sizes), "swiglu")


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_down_backward_kernel_gathered(dtype, activation):
    """The kernel reading ct [T, H] through a row index (tokens -1 and T among the rows; H with a
    K tail) against the float32 reference on the gathered rows, and bitwise equal to the kernel on
    those rows."""
    ct_rows, gate_up, w, w_out, sizes = vjp_problem(dtype, activation, True)
    T = 150
    tokens = np.array(jax.random.randint(jax.random.PRNGKey(9), (ct_rows.shape[0],), 0, T))
    tokens[[0, 5, 70]] = -1, T, -7
    tokens = jnp.asarray(tokens)
    ct = random_float((T, ct_rows.shape[1]), dtype)
    if not down_backward.kernel_fits(ct, gate_up, w_out, activation, gathered=True):
        pytest.skip("the down_backward kernel is not built or this GPU is not sm_90")
    f = jax.jit(functools.partial(down_backward.down_vjp, activation=activation, weighted=True))
    assert "down_backward" in f.lower(ct, gate_up, w, w_out, jnp.asarray(sizes), tokens).as_text()
    got = f(ct, gate_up, w, w_out, jnp.asarray(sizes), tokens)
    rows = gather_gemm.gathered_rows(ct, tokens)
    want = vjp_reference(rows, gate_up, w, w_out, sizes, activation)
    for a, b in zip(got, want):
        scale = max(float(jnp.abs(b).max()), 1.0)
        assert_allclose(a.astype(jnp.float32) / scale, b / scale, 2e-2 if dtype == jnp.bfloat16 else 4e-3)
    for a, b in zip(got, f(rows, gate_up, w, w_out, jnp.asarray(sizes))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def check_kernel(problem, activation):
    ct, gate_up, w, w_out, sizes = problem
    if not down_backward.kernel_fits(ct, gate_up, w_out, activation):
        pytest.skip("the down_backward kernel is not built or this GPU is not sm_90")
    dtype = ct.dtype
    f = jax.jit(functools.partial(vjp_call, activation=activation))
    got = f(ct, gate_up, w, w_out, jnp.asarray(sizes))
    want = vjp_reference(ct, gate_up, w, w_out, sizes, activation)
    for name, a, b in zip(("d_gate_up", "d_w", "w_h"), got, want):
        scale = max(float(jnp.abs(b).max()), 1.0)
        assert a.shape == b.shape, name
        assert_allclose(a.astype(jnp.float32) / scale, b / scale, 2e-2 if dtype == jnp.bfloat16 else 4e-3)
    again = f(ct, gate_up, w, w_out, jnp.asarray(sizes))
    for a, b in zip(got, again):  # bitwise reproducible
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_layer_grads_fused_backward(activation, monkeypatch):
    """bf16 layer gradients with MOE_DOWN_BACKWARD=fused (the kernel on an sm_90 GPU where it fits,
    the composition elsewhere) equal the default's to bf16 rounding."""
    T, E, K, H, F = 96, 4, 2, 64, 128
    x, weights, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation, jnp.bfloat16)
    ct = random_float((T, H), jnp.float32)
    loss = lambda x, w, wi, wo: jnp.vdot(jmp.moe_mlp(x, w, ids, wi, wo, activation=activation).astype(jnp.float32),
                                         ct)
    grads = {}
    for mode in down_backward.MODES:
        monkeypatch.setenv("MOE_DOWN_BACKWARD", mode)
        grads[mode] = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(x, weights, w_in, w_out)
    for mode in ("fused", "gathered"):
        for a, b in zip(grads[mode], grads["composition"]):
            scale = max(float(jnp.abs(b.astype(jnp.float32)).max()), 1e-3)
            assert_allclose(a.astype(jnp.float32) / scale, b.astype(jnp.float32) / scale, 3e-2)


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_layer_gathered_backward_matches_dense(monkeypatch, activation, with_map):
    """MOE_DOWN_BACKWARD=gathered (the second GEMM's backward reading the output's cotangent through
    the row index; the compositions on the CPU): float32 gradients of every argument, with invalid
    and repeated ids and an expert_map, equal the dense MoE's; forward-mode derivatives too."""
    monkeypatch.setenv("MOE_DOWN_BACKWARD", "gathered")
    T, E, K, H, F = 13, 6, 3, 8, 5
    x, weights, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation)
    ids = ids.at[0, 0].set(-1).at[1, 1].set(E).at[2, 2].set(ids[2, 1])
    kwargs, expert_ids = dict(activation=activation), None
    if with_map:  # experts 0, 2, 4 live here, as local 0..2
        kwargs.update(expert_map=jnp.asarray([0, -1, 1, -1, 2, -1], jnp.int32), num_local_experts=3)
        w_in, w_out, expert_ids = w_in[::2], w_out[::2], jnp.asarray([0, 2, 4])
    ours = lambda x, w, wi, wo: jmp.moe_mlp(x, w, ids, wi, wo, **kwargs)
    ref = lambda x, w, wi, wo: dense_moe(x, w, ids, wi, wo, activation, expert_ids)
    ct = random_float((T, H), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    primals = (x, weights, w_in, w_out)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(ours), (0, 1, 2, 3)))(*primals))
    assert "down_vjp" in jaxpr and "gathered=True" in jaxpr and "gather_rhs=True" in jaxpr
    for a, b in zip(jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))(*primals), jax.grad(loss(ref), (0, 1, 2, 3))(*primals)):
        assert_allclose(a, b, 1e-4)
    tangents = tuple(random_float(a.shape, a.dtype) for a in primals)
    for a, b in zip(jax.jvp(ours, primals, tangents), jax.jvp(ref, primals, tangents)):
        assert_allclose(a, b, 1e-4)


def test_down_vjp_gathered_composition():
    """down_vjp with ct read through a row index (tokens -1 and T among the rows) equals it on the
    gathered rows."""
    ct, gate_up, w, w_out, sizes = vjp_problem(jnp.float32, "swiglu", True, H=24, F=40)
    T = 30
    tokens = np.array(jax.random.randint(jax.random.PRNGKey(5), (ct.shape[0],), 0, T))
    tokens[[1, 7]] = -1, T
    x = random_float((T, ct.shape[1]), jnp.float32)
    sizes = jnp.asarray(sizes)
    f = functools.partial(down_backward.down_vjp, activation="swiglu", weighted=True)
    got = jax.jit(f)(x, gate_up, w, w_out, sizes, jnp.asarray(tokens))
    want = jax.jit(f)(gather_gemm.gathered_rows(x, jnp.asarray(tokens)), gate_up, w, w_out, sizes)
    for a, b in zip(got, want):
        assert_allclose(a, b, 1e-6)


def test_down_backward_default_rule(monkeypatch):
    """MOE_DOWN_BACKWARD=preferred (the default) gathers in the layer for fine-grained experts where
    the kernel fits (Qwen3-30B-A3B's shapes at T = 4096), not for wide experts (Mixtral's F), nor
    from MAX_GROUP_ROWS rows a group, nor where no kernel runs; gathered / composition force it."""
    qwen3 = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 2048), (32768, 1536), (128, 768, 2048))]
    mixtral = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 4096), (8192, 28672), (8, 14336, 4096))]
    monkeypatch.delenv("MOE_DOWN_BACKWARD", raising=False)
    fits = down_backward.kernel_fits(*qwen3, "swiglu", gathered=True)
    assert down_backward.layer_gathers(*qwen3, 32768, "swiglu") == fits
    assert not down_backward.layer_gathers(*mixtral, 8192, "swiglu")
    monkeypatch.setattr(down_backward, "kernel_fits", lambda *a, **k: True)
    assert down_backward.layer_gathers(*qwen3, 32768, "swiglu")
    assert not down_backward.layer_gathers(*qwen3, gather_gemm.MAX_GROUP_ROWS * 128, "swiglu")
    assert not down_backward.layer_gathers(*mixtral, 8192, "swiglu")
    monkeypatch.setattr(down_backward, "kernel_fits", lambda *a, **k: False)
    assert not down_backward.layer_gathers(*qwen3, 32768, "swiglu")
    monkeypatch.setenv("MOE_DOWN_BACKWARD", "gathered")
    assert down_backward.layer_gathers(*mixtral, 8192, "swiglu")
    monkeypatch.setenv("MOE_DOWN_BACKWARD", "composition")
    assert not down_backward.layer_gathers(*qwen3, 32768, "swiglu")


@needs_gpu
def test_down_backward_default_gathers_on_gpu(monkeypatch):
    """On the GPU the default takes the gathered kernel for Qwen3-30B-A3B's shapes."""
    monkeypatch.delenv("MOE_DOWN_BACKWARD", raising=False)
    qwen3 = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 2048), (32768, 1536), (128, 768, 2048))]
    assert down_backward.layer_gathers(*qwen3, 32768, "swiglu")


def test_down_backward_switch_checked(monkeypatch):
    """Any other MOE_DOWN_BACKWARD value is an error naming the variable when the layer's
    derivative is traced."""
    args = layer_inputs(5, 4, 2, 8, 6)
    monkeypatch.setenv("MOE_DOWN_BACKWARD", "kernel")
    with pytest.raises(ValueError, match="MOE_DOWN_BACKWARD"):
        jax.grad(lambda x: jnp.sum(jmp.moe_mlp(x, *args[1:])))(args[0])
