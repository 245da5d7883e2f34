"""Layers stacked over a model (moe_mlp(..., layer=i), route_tokens(..., layer=i)): equal to the
call on the layer's own weights, forward and derivatives (zero for the other layers), inside a
lax.scan over the layers, with expert_map and bias, under vmap; the stacked grouped GEMM; bad
arguments. On the GPU the decode kernels, the router kernel and the CUTLASS grouped GEMM read the
layer on the device: same results, and the HLO passes them the whole stack (no dynamic slice)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute import gather_gemm, layer, router_kernel
from conftest import needs_gpu, random_float
from test_decode_mlp import assert_close_to
from test_layer import assert_allclose

NL = 3


def stacks(E, H, F, dtype=jnp.float32, gated=True):
    return (random_float((NL, E, H, (2 if gated else 1) * F), dtype, 0.5), random_float((NL, E, F, H), dtype, 0.5),
            random_float((NL, H, E), dtype, 0.5), random_float((NL, E), jnp.float32, 0.1))


@pytest.mark.parametrize("T,E,K,H,F,activation", [(5, 4, 2, 8, 6, "swiglu"), (1, 8, 2, 16, 8, "relu"),
                                                   (0, 4, 2, 8, 4, "swiglu")])
def test_moe_mlp_layer_equals_its_slice(T, E, K, H, F, activation):
    w_in, w_out, router, _ = stacks(E, H, F, gated=activation == "swiglu")
    x = random_float((T, H), jnp.float32)
    r = jmp.route(random_float((T, E), jnp.float32, 2.0), K)
    f = jax.jit(functools.partial(jmp.moe_mlp, activation=activation))
    for i in (*range(NL), -1, NL + 2, -NL - 3):  # negative from the end, then clamped
        want = f(x, r.weights, r.ids, w_in[i if -NL <= i < NL else (0 if i < 0 else NL - 1)],
                 w_out[i if -NL <= i < NL else (0 if i < 0 else NL - 1)])
        got = jax.jit(lambda x, w, wi, wo, i: jmp.moe_mlp(x, w, r.ids, wi, wo, activation=activation, layer=i))(
            x, r.weights, w_in, w_out, jnp.int32(i))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # derivatives: the layer's slice gets the sliced call's gradient, the other layers zero
    ct = random_float((T, H), jnp.float32)
    loss = lambda x, w, wi, wo: jnp.sum(jmp.moe_mlp(x, w, r.ids, wi, wo, activation=activation, layer=1) * ct)
    g = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(x, r.weights, w_in, w_out)
    loss1 = lambda x, w, wi, wo: jnp.sum(jmp.moe_mlp(x, w, r.ids, wi, wo, activation=activation) * ct)
    g1 = jax.jit(jax.grad(loss1, (0, 1, 2, 3)))(x, r.weights, w_in[1], w_out[1])
    for a, b in zip(g[:2], g1[:2]):
        assert_allclose(a, b)
    for stack, layer_grad in zip(g[2:], g1[2:]):
        assert_allclose(stack[1], layer_grad)
        assert not np.asarray(stack[0]).any() and not np.asarray(stack[2]).any()


def test_stacked_call_keeps_the_stack_whole(monkeypatch):
    """Where the fused first GEMM (gather_gemm) would run, a call with `layer` takes the grouped
    GEMMs that read the layer from the stack instead (the fused kernel takes one layer's weights,
    which XLA would copy out of the stack every call); the unstacked call still takes it. Forced on
    here, where the kernel itself does not run: the branch is chosen while tracing."""
    monkeypatch.setattr(layer, "gathers_rows", lambda *a, **k: True)
    calls = []
    fused = gather_gemm.gather_gemm
    monkeypatch.setattr(gather_gemm, "gather_gemm", lambda *a, **k: calls.append(1) or fused(*a, **k))
    T, E, K, H, F = 9, 4, 2, 8, 6
    w_in, w_out, _, _ = stacks(E, H, F)
    x = random_float((T, H), jnp.float32)
    r = jmp.route(random_float((T, E), jnp.float32, 2.0), K)
    want = jax.jit(lambda x, wi, wo: jmp.moe_mlp(x, r.weights, r.ids, wi, wo))(x, w_in[2], w_out[2])
    assert calls, "the forced branch did not take the fused kernel on unstacked weights"
    calls.clear()
    got = jax.jit(lambda x, wi, wo, i: jmp.moe_mlp(x, r.weights, r.ids, wi, wo, layer=i))(x, w_in, w_out, 2)
    assert not calls
    assert_allclose(got, want)


def test_scan_over_layers_with_expert_map():
    """A model's decode loop: x + moe_mlp(route_tokens(...)) per layer, scanned; equal to the
    same loop over sliced weights."""
    T, E, K, H, F = 4, 8, 2, 16, 8
    w_in, w_out, router, bias = stacks(E, H, F)
    x = random_float((T, H), jnp.float32)
    expert_map = jnp.asarray([0, 1, -1, 2, 3, -1, 4, 5], jnp.int32)  # 6 local experts
    w_in, w_out = w_in[:, :6], w_out[:, :6]
    kw = dict(scoring="sigmoid", num_groups=2, topk_groups=1)

    def stacked(x):
        def body(x, i):
            r = jmp.route_tokens(x, router, K, bias=bias, layer=i, **kw)
            y = jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out, expert_map=expert_map, num_local_experts=6, layer=i)
            return x + y, r.ids
        return jax.lax.scan(body, x, jnp.arange(NL, dtype=jnp.int32))

    def sliced(x):
        def body(x, layer_weights):
            wi, wo, ro, b = layer_weights
            r = jmp.route_tokens(x, ro, K, bias=b, **kw)
            return x + jmp.moe_mlp(x, r.weights, r.ids, wi, wo, expert_map=expert_map, num_local_experts=6), r.ids
        return jax.lax.scan(body, x, (w_in, w_out, router, bias))

    (a, ids_a), (b, ids_b) = jax.jit(stacked)(x), jax.jit(sliced)(x)
    np.testing.assert_array_equal(np.asarray(ids_a), np.asarray(ids_b))
    assert_allclose(a, b)
    ga = jax.jit(jax.grad(lambda x: jnp.sum(stacked(x)[0] ** 2)))(x)
    gb = jax.jit(jax.grad(lambda x: jnp.sum(sliced(x)[0] ** 2)))(x)
    assert_allclose(ga, gb, 1e-4)


def test_route_tokens_layer_gradients_and_vmap():
    T, E, K, H = 3, 8, 2, 16
    _, _, router, bias = stacks(E, H, 4)
    x = random_float((T, H), jnp.float32)
    f = lambda x, ro, i: jmp.route_tokens(x, ro, K, layer=i).weights
    for i in range(NL):
        assert_allclose(jax.jit(f)(x, router, jnp.int32(i)), jmp.route_tokens(x, router[i], K).weights)
    g = jax.grad(lambda x, ro: jnp.sum(f(x, ro, 2) ** 2), (0, 1))(x, router)
    g1 = jax.grad(lambda x, ro: jnp.sum(jmp.route_tokens(x, ro, K).weights ** 2), (0, 1))(x, router[2])
    assert_allclose(g[0], g1[0])
    assert_allclose(g[1][2], g1[1])
    assert not np.asarray(g[1][:2]).any()
    xs = random_float((2, T, H), jnp.float32)
    batched = jax.vmap(lambda x: jmp.route_tokens(x, router, K, layer=1).ids)(xs)
    for v in range(2):
        np.testing.assert_array_equal(np.asarray(batched[v]), np.asarray(jmp.route_tokens(xs[v], router[1], K).ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_primitives_on_every_backend(dtype):
    """The stacked primitives themselves (bound on the GPU at decode sizes; here their
    compositions): equal to the unstacked ones on the layer's slice, under jit, vmap and jvp."""
    from jax_moe_permute import decode_mlp

    T, E, K, H, F = 2, 8, 2, 16, 8
    w_in, w_out, router, bias = stacks(E, H, F, dtype)
    x = random_float((T, H), dtype)
    r = jmp.route(random_float((T, E), jnp.float32, 2.0), K)
    f = jax.jit(lambda x, wi, wo, i: decode_mlp.moe_mlp_decode(x, r.weights, r.ids, wi, wo, activation="swiglu",
                                                                   layer=i))
    g = jax.jit(lambda x, wi, wo: decode_mlp.moe_mlp_decode(x, r.weights, r.ids, wi, wo, activation="swiglu"))
    np.testing.assert_array_equal(np.asarray(f(x, w_in, w_out, 2), np.float32),
                                  np.asarray(g(x, w_in[2], w_out[2]), np.float32))
    xs = jnp.stack([x, random_float((T, H), dtype)])
    batched = jax.vmap(f, (0, None, None, None))(xs, w_in, w_out, 1)
    for v in range(2):  # vmap runs the composition, g the fused kernel on the GPU: bf16 rounds differently
        assert_close_to(batched[v], g(xs[v], w_in[1], w_out[1]), 2e-2 if dtype == jnp.bfloat16 else 1e-6)
    dx, dwi = random_float(x.shape, dtype), random_float(w_in.shape, dtype)
    _, t = jax.jvp(lambda x, wi: f(x, wi, w_out, 0), (x, w_in), (dx, dwi))
    _, t1 = jax.jvp(lambda x, wi: g(x, wi, w_out[0]), (x, w_in[0]), (dx, dwi[0]))
    assert_allclose(t, t1, 2e-2 if dtype == jnp.bfloat16 else 1e-5)
    # route_tokens binds its stacked primitive for a few bf16 / f16 tokens
    kw = dict(scoring="sigmoid", num_groups=2, topk_groups=1)
    got = jax.jit(lambda x, ro, b: jmp.route_tokens(x, ro, K, bias=b, layer=1, **kw))(x, router, bias)
    want = jmp.route_tokens(x, router[1], K, bias=bias[1], **kw)
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
    assert_allclose(got.weights, want.weights)
    gr = jax.grad(lambda ro: jnp.sum(jmp.route_tokens(x, ro, K, layer=1).weights ** 2))(router)
    gr1 = jax.grad(lambda ro: jnp.sum(jmp.route_tokens(x, ro, K).weights ** 2))(router[1])
    assert_allclose(gr[1], gr1, 2e-2 if dtype == jnp.bfloat16 else 1e-5)
    assert not np.asarray(gr[0], np.float32).any()
    bx = jax.vmap(lambda x: jmp.route_tokens(x, router, K, layer=0).ids)(xs)
    for v in range(2):
        np.testing.assert_array_equal(np.asarray(bx[v]), np.asarray(jmp.route_tokens(xs[v], router[0], K).ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_dot_stacked(dtype):
    """The grouped GEMM on a layer of a stacked rhs (moe_mlp's stacked forward above decode
    sizes): equal to ragged_dot on the slice, for negative and clamped layers too, under vmap
    and jvp."""
    from jax_moe_permute.grouped_gemm import ragged_dot, ragged_dot_stacked

    lhs, rhs = random_float((13, 16), dtype), random_float((NL, 4, 16, 8), dtype)
    sizes = jnp.asarray([3, 0, 6, 2], jnp.int32)
    f = jax.jit(ragged_dot_stacked)
    for i in (0, NL - 1, -1, NL + 3, -NL - 2):
        j = i if -NL <= i < NL else (0 if i < 0 else NL - 1)
        np.testing.assert_array_equal(np.asarray(f(lhs, rhs, sizes, i), np.float32),
                                      np.asarray(ragged_dot(lhs, rhs[j], sizes), np.float32))
    lhss = jnp.stack([lhs, random_float(lhs.shape, dtype)])
    batched = jax.vmap(ragged_dot_stacked, (0, None, None, None))(lhss, rhs, sizes, 1)
    for v in range(2):
        np.testing.assert_array_equal(np.asarray(batched[v], np.float32),
                                      np.asarray(ragged_dot(lhss[v], rhs[1], sizes), np.float32))
    d_lhs, d_rhs = random_float(lhs.shape, dtype), random_float(rhs.shape, dtype)
    _, t = jax.jvp(lambda a, b: ragged_dot_stacked(a, b, sizes, 2), (lhs, rhs), (d_lhs, d_rhs))
    _, t1 = jax.jvp(lambda a, b: ragged_dot(a, b, sizes), (lhs, rhs[2]), (d_lhs, d_rhs[2]))
    np.testing.assert_array_equal(np.asarray(t, np.float32), np.asarray(t1, np.float32))


def test_bad_arguments():
    T, E, K, H, F = 2, 4, 2, 8, 4
    w_in, w_out, router, bias = stacks(E, H, F)
    x = random_float((T, H), jnp.float32)
    r = jmp.route(random_float((T, E), jnp.float32), K)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out, layer=1.0)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out, layer=jnp.arange(2))
    with pytest.raises(ValueError, match="w_in must have shape"):
        jmp.moe_mlp(x, r.weights, r.ids, w_in[..., :5], w_out, layer=0)
    with pytest.raises(ValueError, match="same number"):
        jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out[:2], layer=0)
    with pytest.raises(ValueError, match="w_in must be a 4-D stack"):
        jmp.moe_mlp(x, r.weights, r.ids, w_in[0], w_out[0], layer=0)  # not stacked
    with pytest.raises(ValueError, match="router must be a float array of shape"):
        jmp.route_tokens(x, router[0], K, layer=0)
    with pytest.raises(ValueError, match="bias"):
        jmp.route_tokens(x, router, K, bias=bias[0], layer=0, scoring="sigmoid")


# ---- the kernels on the GPU --------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("model", ["qwen3_small", "mixtral_small"])
def test_decode_kernels_read_the_layer(model):
    """T = 1 decode shapes: the stacked call lowers to the stacked kernels (no dynamic slice of
    the stack in the scan's HLO) and equals the sliced call bitwise, for every layer, replayed
    with new inputs."""
    E, K, H, F = {"qwen3_small": (64, 8, 256, 128), "mixtral_small": (8, 2, 256, 512)}[model]
    w_in, w_out, router, _ = stacks(E, H, F, jnp.bfloat16)
    router = router * 0.1

    def step(stacked, x):
        def body(x, i):
            if stacked:
                r = jmp.route_tokens(x, router, K, layer=i)
                return x + jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out, layer=i), None
            r = jmp.route_tokens(x, router[i], K)
            return x + jmp.moe_mlp(x, r.weights, r.ids, w_in[i], w_out[i]), None
        return jax.lax.scan(body, x, jnp.arange(NL, dtype=jnp.int32))[0]

    # the layer read on the device as lax.dynamic_index_in_dim reads it: from the end, clamped
    x = random_float((1, H), jnp.bfloat16)
    r1 = jmp.route_tokens(x, router[NL - 1], K)
    last = jax.jit(lambda x, i: jmp.moe_mlp(x, r1.weights, r1.ids, w_in, w_out, layer=i))
    want = jmp.moe_mlp(x, r1.weights, r1.ids, w_in[NL - 1], w_out[NL - 1])
    for i in (NL - 1, -1, NL + 4):
        np.testing.assert_array_equal(np.asarray(last(x, i), np.float32), np.asarray(want, np.float32))
    stacked, sliced = jax.jit(functools.partial(step, True)), jax.jit(functools.partial(step, False))
    hlo = stacked.lower(random_float((1, H), jnp.bfloat16)).as_text()
    assert "moe_mlp_decode_stacked" in hlo
    for _ in range(3):  # new inputs, the same executables
        x = random_float((1, H), jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(stacked(x), np.float32), np.asarray(sliced(x), np.float32))
    # above decode sizes the grouped GEMMs read the layer (CUTLASS, ragged_dot_stacked)
    x8 = random_float((8, H), jnp.bfloat16)
    r8 = jmp.route_tokens(x8, router[1], K)
    big = jax.jit(lambda x, i: jmp.moe_mlp(x, r8.weights, r8.ids, w_in, w_out, layer=i))
    assert "ragged_dot_stacked" in big.lower(x8, 1).as_text()  # past the decode rule: the CUTLASS path
    want8 = jmp.moe_mlp(x8, r8.weights, r8.ids, w_in[1], w_out[1])
    for i in (1, 1 - NL):
        np.testing.assert_array_equal(np.asarray(big(x8, i), np.float32), np.asarray(want8, np.float32))
    with router_kernel.hidden_kernel_wherever_it_fits():
        x = random_float((1, H), jnp.bfloat16)
        hlo = jax.jit(lambda x: jmp.route_tokens(x, router, K, layer=2).ids).lower(x).as_text()
        assert "router_hidden_stacked" in hlo
        got = jax.jit(lambda x: jmp.route_tokens(x, router, K, layer=2))(x)
        want = jax.jit(lambda x: jmp.route_tokens(x, router[2], K))(x)
        np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
        np.testing.assert_array_equal(np.asarray(got.weights), np.asarray(want.weights))


@needs_gpu
@pytest.mark.parametrize("model", ["qwen3_small", "mixtral_small"])
def test_prefill_groups_keep_the_stack_whole(model, monkeypatch):
    """At the group sizes where the unstacked forward takes the fused first GEMM (128 rows a group),
    the stacked call lowers to the grouped GEMMs that read the layer (no gather_gemm, which would
    take a copy of the layer's weights), equal to the unstacked call to rounding."""
    monkeypatch.delenv("MOE_GATHER_GEMM", raising=False)
    E, K, H, F = {"qwen3_small": (64, 8, 256, 128), "mixtral_small": (8, 2, 256, 512)}[model]
    w_in, w_out, router, _ = stacks(E, H, F, jnp.bfloat16)
    x = random_float((128 * E // K, H), jnp.bfloat16)
    r = jmp.route_tokens(x, router[1] * 0.1, K)
    stacked = jax.jit(lambda x, i: jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out, layer=i))
    sliced = jax.jit(lambda x: jmp.moe_mlp(x, r.weights, r.ids, w_in[1], w_out[1]))
    hlo = stacked.lower(x, 1).as_text()
    assert "ragged_dot_stacked" in hlo and "jax_moe_permute.gather_gemm" not in hlo
    assert "jax_moe_permute.gather_gemm" in sliced.lower(x).as_text()
    assert_close_to(stacked(x, 1), sliced(x), 2e-2)
