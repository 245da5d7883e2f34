"""GPU-only checks: sizes past 2^31 elements, CUDA-graph replay, the CUDA targets in use."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from conftest import assert_bits_equal, needs_gpu, random_float, random_ids


@needs_gpu
def test_cuda_module_is_loaded():
    assert "cuda" in jmp._native.platforms()
    text = jax.jit(lambda h, i: jmp.moe_permute(h, i, 4)).lower(
        jnp.ones((3, 4), jnp.float32), jnp.zeros((3, 2), jnp.int32)).compile().as_text()
    assert "jax_moe_permute.permute" in text


@needs_gpu
def test_more_than_2_pow_31_elements():
    T, K, H, E = 65536, 8, 4608, 256
    hidden = random_float((T, H), jnp.bfloat16)
    ids = random_ids(T, K, E, low=0, high_extra=0)
    res = jax.jit(lambda h, i: jmp.moe_permute(h, i, E))(hidden, ids)
    assert res.hidden.size > 2**31
    rm = np.asarray(res.row_map)
    rng = np.random.default_rng(0)
    tokens = np.concatenate([rng.integers(0, T, 64), [0, T - 1]])
    h_np = np.asarray(hidden[tokens]).view(np.uint16)
    for j, t in enumerate(tokens):
        for k in range(K):
            row = np.asarray(res.hidden[int(rm[t, k])]).view(np.uint16)
            np.testing.assert_array_equal(row, h_np[j])
    last = int(np.max(rm))  # the very last rows sit past 2^31 elements
    assert last * H > 2**31
    out = jax.jit(jmp.moe_unpermute)(res.hidden, res.row_map)
    got = np.asarray(out[tokens].astype(jnp.float32))
    want = K * np.asarray(hidden[tokens].astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-2)


@needs_gpu
def test_deterministic_under_cuda_graphs():
    """Outputs are bitwise identical across repeated runs and command-buffer replays."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jax_moe_permute as jmp
        k = jax.random.split(jax.random.PRNGKey(7), 3)
        h = jax.random.normal(k[0], (3000, 1000)).astype(jnp.bfloat16)
        ids = jax.random.randint(k[1], (3000, 8), -1, 70)
        w = jax.random.uniform(k[2], (3000, 8))
        def f(h, ids, w):
            res = jmp.moe_permute(h, ids, 64, align_size=16)
            out = jmp.moe_unpermute(res.hidden * 3, res.row_map, w)
            g = jax.grad(lambda a, b: jnp.sum(jmp.moe_unpermute(a, res.row_map, b).astype(jnp.float32) ** 2),
                         argnums=(0, 1))(res.hidden, w)
            return res, out, g
        f = jax.jit(f)
        first = jax.tree.map(np.asarray, f(h, ids, w))
        for _ in range(5):
            again = jax.tree.map(np.asarray, f(h, ids, w))
            for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        print("DETERMINISTIC")
    """)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DETERMINISTIC" in out.stdout


# Launch choices that only batches of thousands of tokens reach: tiles of 256 entries with
# mostly empty shares (Mixtral-like), of 512 (L=128), of 2048 with more than kMaxShare tiles
# per offsets thread (L=1000); the weight gradient's warp per entry (rows <= 4 KiB) and block
# per entry (longer rows); the scatter's 4 vectors per thread.
@needs_gpu
@pytest.mark.parametrize("T,H,E,K", [(4096, 256, 8, 2), (3000, 2048, 128, 8), (2500, 1024, 1000, 8),
                                     (2200, 2560, 16, 2)])
def test_large_batches_match_reference(T, H, E, K):
    hidden = random_float((T, H), jnp.bfloat16)
    ids = random_ids(T, K, E)
    for align_size in (1, 128):
        fn = lambda lib: jax.jit(lambda h, i: lib.moe_permute(h, i, E, align_size=align_size))
        for got, want in zip(fn(jmp)(hidden, ids), fn(jmp.reference)(hidden, ids)):
            assert_bits_equal(got, want)
    res = jmp.moe_permute(hidden, ids, E)
    x = random_float(res.hidden.shape, jnp.bfloat16)
    w = jax.random.uniform(jax.random.PRNGKey(T), (T, K))
    ct = random_float((T, H), jnp.bfloat16)
    grads = lambda lib: jax.jit(jax.grad(
        lambda a, b: jnp.vdot(ct.astype(jnp.float32), lib.moe_unpermute(a, res.row_map, b).astype(jnp.float32)),
        argnums=(0, 1)))(x, w)
    (dx, dw), (dx_ref, dw_ref) = grads(jmp), grads(jmp.reference)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-3, atol=1e-3 * np.sqrt(H))


# A decode step as serving code writes it: a jitted lax.scan over stacked layer weights, each
# layer x + moe_mlp(x, route_tokens(x, router)) (ours: the add as moe_mlp's residual); replayed on new
# inputs in new buffers each call.
DECODE_STEP_SCRIPT = textwrap.dedent("""
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_moe_permute as jmp
    from jax_moe_permute import router_kernel
    from jax_moe_permute.layer import reference_moe_mlp
    L, T, E, K, H, F = 3, int(sys.argv[1]), 16, 4, 256, 128

    def step(x, router, w_in, w_out, mlp, dtype):
        # Every layer routes the step's input (bf16 in both), so ours and the float32 reference
        # choose the same experts and differ by rounding only.
        def layer(h, w):
            r = jmp.route_tokens(x, w[0], K)  # route(router_logits(x, w[0]), K), one launch here
            w_in, w_out = w[1].astype(dtype), w[2].astype(dtype)
            if mlp is jmp.moe_mlp:
                return mlp(h, r.weights, r.ids, w_in, w_out, residual=h), None
            return h + mlp(h, r.weights, r.ids, w_in, w_out), None
        return jax.lax.scan(layer, x.astype(dtype), (router, w_in, w_out))[0]

    ours = jax.jit(lambda *a: step(*a, jmp.moe_mlp, jnp.bfloat16))
    ref = jax.jit(lambda *a: step(*a, reference_moe_mlp, jnp.float32))
    with router_kernel.hidden_kernel_wherever_it_fits():  # the fused router for T <= 8, E = 16
        compiled = ours.lower(*(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
                                ((T, H), (L, H, E), (L, E, H, 2 * F), (L, E, F, H)))).compile()
    text = compiled.as_text()
    print("CUSTOM_CALLS", sorted(set(re.findall(r'custom_call_target="(jax_moe_permute[.a-z_]*)"', text))))
    for i in range(6):  # fresh arrays each call: new inputs at new buffer addresses
        k = jax.random.split(jax.random.PRNGKey(100 + i), 4)
        x = jax.random.normal(k[0], (T, H), jnp.float32).astype(jnp.bfloat16)
        router = jax.random.normal(k[1], (L, H, E), jnp.float32).astype(jnp.bfloat16)
        w_in = (jax.random.normal(k[2], (L, E, H, 2 * F), jnp.float32) / 16).astype(jnp.bfloat16)
        w_out = (jax.random.normal(k[3], (L, E, F, H), jnp.float32) / 11).astype(jnp.bfloat16)
        got = np.asarray(compiled(x, router, w_in, w_out), np.float32)
        want = np.asarray(ref(x, router, w_in, w_out), np.float32)
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1.0)
        assert err < 3e-2, (i, err)
    print("REPLAYED")
""")


@needs_gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("flags", ["", " --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                       "WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"])
def test_decode_step_graph_replay(tokens, flags):
    """Every custom call of a decode step is graph-safe: with XLA's default command buffers and
    with whole while loops captured, repeated calls on new inputs and new buffers stay right."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + flags).strip()
    out = subprocess.run([sys.executable, "-c", DECODE_STEP_SCRIPT, str(tokens)], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REPLAYED" in out.stdout
    if tokens <= 8:  # the fused router (product and choice) is in the step
        assert "jax_moe_permute.router_hidden" in out.stdout, out.stdout
    if tokens == 1:  # and the fused decode MLP with the residual add
        assert "jax_moe_permute.moe_mlp_decode_residual" in out.stdout, out.stdout
    if tokens == 64:  # the unfused path: the residual in the unpermute's launch
        assert "jax_moe_permute.unpermute_add" in out.stdout, out.stdout
    print(out.stdout)


# A training step on the hand-written graph-safe kernels (the fused first GEMM, our persistent dW
# kernel, the d lhs GEMM with the activation's backward): jit(grad) compiled once, called on new
# inputs in new buffers, against float32 grads.
TRAIN_STEP_SCRIPT = textwrap.dedent("""
    import os, re, sys
    kernels, tile = sys.argv[1], sys.argv[2]
    ours = kernels.startswith("ours")
    os.environ["MOE_GATHER_GEMM"] = "1" if ours else "0"
    os.environ["MOE_GROUPED_GEMM_DW_KERNEL"] = "persistent" if ours else "cutlass"
    os.environ["MOE_DOWN_BACKWARD"] = {"ours": "fused", "ours-gathered": "gathered"}.get(kernels, "composition")
    if tile != "auto":
        os.environ["MOE_GROUPED_GEMM_TILE"] = tile
    import jax, jax.numpy as jnp, numpy as np
    import jax_moe_permute as jmp
    from jax_moe_permute.layer import reference_moe_mlp
    T, E, K, H, F = 512, 16, 4, 256, 128

    def loss(mlp, dtype):
        def f(x, weights, ids, w_in, w_out, ct):
            y = mlp(x.astype(dtype), weights, ids, w_in.astype(dtype), w_out.astype(dtype))
            return jnp.sum(y.astype(jnp.float32) * ct)
        return jax.grad(f, (0, 1, 3, 4))

    shapes = ((T, H), (T, K), (T, K), (E, H, 2 * F), (E, F, H), (T, H))
    dtypes = (jnp.bfloat16, jnp.float32, jnp.int32, jnp.bfloat16, jnp.bfloat16, jnp.float32)
    compiled = jax.jit(loss(jmp.moe_mlp, jnp.bfloat16)).lower(
        *(jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes))).compile()
    text = compiled.as_text()
    print("CUSTOM_CALLS", sorted(set(re.findall(r'custom_call_target="(jax_moe_permute[.a-z_0-9]*)"', text))))
    ref = jax.jit(loss(reference_moe_mlp, jnp.float32))
    for i in range(4):  # fresh arrays each call: new inputs at new buffer addresses
        k = jax.random.split(jax.random.PRNGKey(200 + i), 6)
        x = jax.random.normal(k[0], (T, H), jnp.float32).astype(jnp.bfloat16)
        weights = jax.random.uniform(k[1], (T, K), jnp.float32)
        ids = jax.random.randint(k[2], (T, K), 0, E)
        w_in = (jax.random.normal(k[3], (E, H, 2 * F), jnp.float32) / 16).astype(jnp.bfloat16)
        w_out = (jax.random.normal(k[4], (E, F, H), jnp.float32) / 11).astype(jnp.bfloat16)
        ct = jax.random.normal(k[5], (T, H), jnp.float32)
        args = (x, weights, ids, w_in, w_out, ct)
        for name, got, want in zip(("x", "weights", "w_in", "w_out"), compiled(*args), ref(*args)):
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
            assert err < 3e-2, (i, name, err)
    print("REPLAYED")
""")


@needs_gpu
@pytest.mark.parametrize("flags", ["", " --xla_gpu_graph_min_graph_size=1"])
@pytest.mark.parametrize("kernels,tile", [("ours", "auto"), ("ours-gathered", "auto"), ("cutlass", "auto"),
                                          ("cutlass", "64x256")])
def test_train_step_graph_replay(kernels, tile, flags):
    """A jit(grad) of the layer under XLA's command buffers stays right on new inputs in new
    buffers: on our hand-written kernels (the fused first GEMM, our dW kernel plain and gathered,
    down_backward, and with MOE_DOWN_BACKWARD=gathered their forms reading the cotangent through
    the row index) and
    on CUTLASS's (both of its forward tiles the layer takes, its dW)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + flags).strip()
    out = subprocess.run([sys.executable, "-c", TRAIN_STEP_SCRIPT, kernels, tile], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REPLAYED" in out.stdout
    targets = {"ours": ("jax_moe_permute.gather_gemm", "jax_moe_permute.ragged_dot_wgrad_sm90",
                        "jax_moe_permute.gathered_wgrad_sm90", "jax_moe_permute.down_backward"),
               # both weight gradients gathered: x's rows for w_in's, the cotangent's for w_out's
               "ours-gathered": ("jax_moe_permute.gather_gemm", "jax_moe_permute.gathered_wgrad_sm90",
                                 "jax_moe_permute.down_backward"),
               "cutlass": ("jax_moe_permute.ragged_dot", "jax_moe_permute.ragged_dot_weight_grad")}[kernels]
    for target in targets:
        assert f"'{target}'" in out.stdout, out.stdout
    print(out.stdout)
