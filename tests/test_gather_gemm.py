"""The fused gather + grouped GEMM + activation (gather_gemm.gather_gemm): the primitive against the
float32 `precision=HIGHEST` reference on every backend (its unfused lowering on CPU), its batching
and JVP, bad arguments; the layer's branch that uses it (forced on CPU, chosen on the GPU) against
the dense MoE forward and gradients; on the GPU the kernel itself: every activation and dtype,
groups empty / one row / around the 128-row tile, tokens out of range, rows past the groups' sum,
the K tail of H, bitwise reproducible, equal to the unfused path to rounding."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_permute as jmp
from jax_moe_permute import gather_gemm, layer
from conftest import fresh_key, needs_gpu, random_float
from test_layer import assert_allclose, dense_moe, layer_inputs

ACTIVATIONS = ["swiglu", "geglu", "gelu", "relu"]
PRIMITIVE_ACTIVATIONS = ACTIVATIONS + ["none"]  # none: a plain grouped GEMM of gathered rows
GATED = {"swiglu": True, "geglu": True, "gelu": False, "relu": False, "none": False}
TARGET = "jax_moe_permute.gather_gemm"


def problem(T, H, F, sizes, activation, dtype, extra_rows=0):
    """x [T, H], row_token [M] (with tokens -1 and T among them), group_sizes, w [G, H, N]."""
    sizes = np.asarray(sizes, np.int32)
    M = int(np.clip(sizes, 0, None).sum()) + extra_rows
    N = 2 * F if GATED[activation] else F
    tokens = np.array(jax.random.randint(fresh_key(), (M,), 0, max(T, 1)))
    if M >= 3:
        tokens[1], tokens[M // 2] = -1, T  # no input: zero rows
    x = random_float((T, H), dtype)
    w = random_float((len(sizes), H, N), dtype, 1.0 / np.sqrt(H))
    return x, jnp.asarray(tokens, jnp.int32), jnp.asarray(sizes), w


def reference(x, row_token, group_sizes, w, activation):
    """Float32, precision HIGHEST: each row's own expert by an explicit group id."""
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    rows = gather_gemm.gathered_rows(x32, row_token)
    sizes = np.clip(np.asarray(group_sizes), 0, None)
    group = np.repeat(np.arange(len(sizes)), sizes)[:rows.shape[0]]
    live = np.zeros(rows.shape[0], bool)
    live[:len(group)] = True
    group = np.concatenate([group, np.zeros(rows.shape[0] - len(group), int)])
    pre = jnp.einsum("mh,mhn->mn", rows, w32[group], precision=jax.lax.Precision.HIGHEST)
    pre = jnp.where(live[:, None], pre, 0.0)
    return (pre if activation == "none" else layer.apply_activation(pre, activation)), pre


def check(x, row_token, sizes, w, activation, tol):
    f = jax.jit(functools.partial(gather_gemm.gather_gemm, activation=activation, save_pre=True))
    out, pre = f(x, row_token, sizes, w)
    want_out, want_pre = reference(x, row_token, sizes, w, activation)
    scale = max(float(jnp.abs(want_pre).max(initial=0.0)), 1.0)
    assert out.shape == want_out.shape and out.dtype == x.dtype
    assert_allclose(out / scale, want_out / scale, tol)
    assert_allclose(pre / scale, want_pre / scale, tol)
    out_only, none = jax.jit(functools.partial(gather_gemm.gather_gemm, activation=activation))(x, row_token, sizes, w)
    assert none is None
    np.testing.assert_array_equal(np.asarray(out_only, np.float32), np.asarray(out, np.float32))
    return f


@pytest.mark.parametrize("activation", PRIMITIVE_ACTIVATIONS)
@pytest.mark.parametrize("T,H,F,sizes,extra", [
    (7, 16, 8, [3, 0, 5, 2], 0), (5, 8, 3, [4], 2), (1, 1, 1, [1, 0], 0), (0, 8, 4, [0, 0], 3),
    (9, 24, 16, [0, 6, 1, 0, 4], 1)])
def test_primitive_matches_reference(activation, T, H, F, sizes, extra):
    check(*problem(T, H, F, sizes, activation, jnp.float32, extra), activation, 1e-5)


def test_primitive_vmap_and_jvp():
    x, tokens, sizes, w = problem(6, 8, 4, [2, 3, 4], "swiglu", jnp.float32)
    xs = jnp.stack([x, random_float(x.shape, x.dtype)])
    f = functools.partial(gather_gemm.gather_gemm, activation="swiglu", save_pre=True)
    outs = jax.jit(jax.vmap(f, (0, None, None, None)))(xs, tokens, sizes, w)
    for v in range(2):
        want = reference(xs[v], tokens, sizes, w, "swiglu")
        for got, ref in zip(outs, want):
            assert_allclose(got[v], ref)
    dx, dw = random_float(x.shape, x.dtype), random_float(w.shape, w.dtype)
    g = lambda x, w: reference(x, tokens, sizes, w, "swiglu")
    (out, pre), (d_out, d_pre) = jax.jvp(lambda x, w: f(x, tokens, sizes, w), (x, w), (dx, dw))
    (want, want_pre), (d_want, d_want_pre) = jax.jvp(g, (x, w), (dx, dw))
    for a, b in ((out, want), (pre, want_pre), (d_out, d_want), (d_pre, d_want_pre)):
        assert_allclose(a, b, 1e-5)


def test_bad_arguments():
    x, tokens, sizes, w = problem(4, 8, 4, [2, 2], "swiglu", jnp.float32)
    f = gather_gemm.gather_gemm
    with pytest.raises(ValueError, match="activation"):
        f(x, tokens, sizes, w, activation="tanh")
    with pytest.raises(ValueError, match="x must"):
        f(x[0], tokens, sizes, w, activation="swiglu")
    with pytest.raises(ValueError, match="w must"):
        f(x, tokens, sizes, w[:, :4], activation="swiglu")
    with pytest.raises(ValueError, match="group_sizes"):
        f(x, tokens, sizes[:1], w, activation="swiglu")
    with pytest.raises(ValueError, match="even"):
        f(x, tokens, sizes, w[..., :7], activation="swiglu")
    with pytest.raises(TypeError, match="row_token"):
        f(x, tokens.astype(jnp.float32), sizes, w, activation="swiglu")


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_layer_branch_matches_dense(monkeypatch, activation, with_map):
    """moe_mlp's gathered branch (routing_rows, the primitive, the JVP's saved pre-activation),
    forced where the kernel does not run: forward and gradients equal the dense MoE."""
    monkeypatch.setattr(layer, "gathers_rows", lambda *a, **k: True)
    T, E, K, H, F = 13, 6, 3, 8, 5
    x, weights, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation)
    ids = ids.at[0, 0].set(-1).at[1, 1].set(E).at[2, 2].set(ids[2, 1])
    kwargs = dict(activation=activation)
    expert_ids = None
    if with_map:  # experts 0, 2, 4 live here, as local 0..2
        expert_map = jnp.asarray([0, -1, 1, -1, 2, -1], jnp.int32)
        kwargs.update(expert_map=expert_map, num_local_experts=3)
        w_in, w_out, expert_ids = w_in[::2], w_out[::2], jnp.asarray([0, 2, 4])
    ours = lambda x, w, wi, wo: jmp.moe_mlp(x, w, ids, wi, wo, **kwargs)
    ref = lambda x, w, wi, wo: dense_moe(x, w, ids, wi, wo, activation, expert_ids)
    assert_allclose(jax.jit(ours)(x, weights, w_in, w_out), ref(x, weights, w_in, w_out))
    ct = random_float((T, H), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    g = jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))(x, weights, w_in, w_out)
    g_ref = jax.grad(loss(ref), (0, 1, 2, 3))(x, weights, w_in, w_out)
    for a, b in zip(g, g_ref):
        assert_allclose(a, b, 1e-4)


def expert_mlp_inputs(activation, dtype=jnp.float32, R=45, G=4, H=8, F=6):
    rows = random_float((R, H), dtype)
    sizes = jnp.asarray([11, 0, 20, 9], jnp.int32)[:G]  # 5 rows past the sum
    w_in = random_float((G, H, 2 * F if GATED[activation] else F), dtype, 0.5)
    w_out = random_float((G, F, H), dtype, 0.5)
    return rows, sizes, w_in, w_out


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_expert_mlp_branch_matches_plain(monkeypatch, activation):
    """expert_mlp's fused-activation branch (the primitive on rows in order, its own JVP), forced
    where the kernel does not run, against the plain composition: forward, jax.grad w.r.t. rows and
    both weights, a JVP in every argument, vmap, and under jax.checkpoint."""
    rows, sizes, w_in, w_out = expert_mlp_inputs(activation)
    plain = lambda r, wi, wo: layer.expert_mlp(r, sizes, wi, wo, activation)
    monkeypatch.setattr(layer, "_fuses_activation", lambda *a, **k: True)
    fused = lambda r, wi, wo: layer.expert_mlp(r, sizes, wi, wo, activation)
    assert "custom_jvp_call" in str(jax.make_jaxpr(fused)(rows, w_in, w_out))
    args = (rows, w_in, w_out)
    assert_allclose(jax.jit(fused)(*args), plain(*args), 1e-5)
    ct = random_float(rows.shape, jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    for wrap in (lambda f: f, jax.checkpoint):
        for a, b in zip(jax.jit(jax.grad(wrap(loss(fused)), (0, 1, 2)))(*args), jax.grad(loss(plain), (0, 1, 2))(*args)):
            assert_allclose(a, b, 1e-4)
    tangents = tuple(random_float(a.shape, a.dtype) for a in args)
    for a, b in zip(jax.jvp(fused, args, tangents), jax.jvp(plain, args, tangents)):
        assert_allclose(a, b, 1e-4)
    for a, b in zip(jax.jvp(lambda wo: fused(rows, w_in, wo), (w_out,), (tangents[2],)),
                    jax.jvp(lambda wo: plain(rows, w_in, wo), (w_out,), (tangents[2],))):
        assert_allclose(a, b, 1e-4)  # only w_out moves: the other tangents are symbolic zeros
    batch = jnp.stack([rows, 2 * rows])
    assert_allclose(jax.vmap(fused, (0, None, None))(batch, w_in, w_out),
                    jax.vmap(plain, (0, None, None))(batch, w_in, w_out), 1e-5)


LOWERS_PER_DEVICE = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    from jax.sharding import Mesh, PartitionSpec as P
    from jax_moe_permute import _compat

    seen = []
    probe = Primitive("lowers_per_device_probe")
    probe.def_abstract_eval(lambda x: x)
    probe.def_impl(lambda x: x)

    def lower(ctx, x):
        seen.append(_compat.lowers_per_device(ctx))
        return [x]

    mlir.register_lowering(probe, lower)
    devices = np.array(jax.devices()[:2])
    assert len(devices) == 2
    jax.jit(probe.bind).lower(jnp.ones(4))
    two = Mesh(devices, ("e",))
    jax.jit(jax.shard_map(probe.bind, mesh=two, in_specs=P("e"), out_specs=P("e"))).lower(jnp.ones(4))
    grid = Mesh(devices.reshape(2, 1), ("e", "t"))
    partial = jax.shard_map(probe.bind, mesh=grid, in_specs=P("e"), out_specs=P("e"), axis_names={"e"})
    jax.jit(partial).lower(jnp.ones(4))
    assert seen == [True, True, False], seen
    print("OK")
""")


def test_lowers_per_device_inside_shard_map():
    """gather_gemm's kernel may be emitted as it is on one device and inside a shard_map manual over
    every mesh axis (each device runs its own program), not where the SPMD partitioner would have
    to split it (a shard_map manual over some axes only). Two CPU devices, in a subprocess: the
    device count is fixed when jax starts."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(jmp.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", LOWERS_PER_DEVICE], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def test_routing_rows_tokens():
    """Each row's token, -1 past the routed rows (dropped ids), and the permute's own layout."""
    x = random_float((5, 3), jnp.float32)
    ids = jnp.asarray([[0, 2], [1, -1], [2, 2], [5, 0], [1, 0]], jnp.int32)
    row_token, sizes, row_map = layer.routing_rows(x, ids, 3)
    res = jmp.moe_permute(x, ids, 3)
    np.testing.assert_array_equal(sizes, res.group_sizes)
    np.testing.assert_array_equal(row_map, res.row_map)
    rows = np.asarray(gather_gemm.gathered_rows(x, row_token))
    np.testing.assert_array_equal(rows, np.asarray(res.hidden))
    assert (np.asarray(row_token)[int(np.asarray(sizes).sum()):] == -1).all()


# ---- the kernel on the GPU --------------------------------------------------------------

def lowered_text(f, *args):
    # A fresh function each time: jit caches its trace per function, and the branch (read from the
    # environment) is chosen while tracing.
    return jax.jit(lambda *a: f(*a)).lower(*args).as_text()


GPU_SIZES = [
    [128], [1], [0, 129, 0, 127], [255, 256, 1, 0, 3], [0] * 5 + [300] + [0] * 3, [64, 200, 17, 128, 130],
    [192, 193, 65],  # last tiles of 64 rows (consumer 1 all padding: it skips) and of 65 and 65 rows
]


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", PRIMITIVE_ACTIVATIONS)
def test_kernel_matches_reference(activation, dtype):
    H, F = 200, 128  # H % 64 != 0: the K tail
    for sizes in GPU_SIZES:
        args = problem(97, H, F, sizes, activation, dtype, extra_rows=5)
        if not gather_gemm.kernel_fits(args[0], args[3], args[1].shape[0], activation):
            pytest.skip(f"the kernel does not take {activation} (gather_gemm_fits)")
        f = functools.partial(gather_gemm.gather_gemm, activation=activation, save_pre=True)
        assert TARGET in lowered_text(f, *args)
        check(*args, activation, 2e-2)


def test_schedule_variable(monkeypatch):
    """MOE_GATHER_GEMM_SCHEDULE names dynamic (the default) or static; anything else is an error
    naming the variable, raised when the kernel's call is lowered."""
    monkeypatch.delenv("MOE_GATHER_GEMM_SCHEDULE", raising=False)
    assert gather_gemm.check_schedule_variable() == "dynamic"
    for schedule in gather_gemm.SCHEDULES:
        monkeypatch.setenv("MOE_GATHER_GEMM_SCHEDULE", schedule)
        assert gather_gemm.check_schedule_variable() == schedule
    monkeypatch.setenv("MOE_GATHER_GEMM_SCHEDULE", "round-robin")
    with pytest.raises(ValueError, match="MOE_GATHER_GEMM_SCHEDULE"):
        gather_gemm.check_schedule_variable()


@needs_gpu
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_kernel_schedules_agree(activation, monkeypatch):
    """The tile schedules (MOE_GATHER_GEMM_SCHEDULE, read at every launch) write bitwise the same
    out and pre, on group sizes that leave most blocks several tiles of unequal length and on
    more blocks than tiles."""
    for T, H, F, sizes in ((700, 256, 256, [0, 300, 1, 129, 64, 0, 450, 65, 2000, 7]), (40, 128, 128, [3, 0, 30])):
        args = problem(T, H, F, sizes, activation, jnp.bfloat16, extra_rows=3)
        f = jax.jit(functools.partial(gather_gemm.gather_gemm, activation=activation, save_pre=True))
        got = {}
        for schedule in gather_gemm.SCHEDULES:
            monkeypatch.setenv("MOE_GATHER_GEMM_SCHEDULE", schedule)
            got[schedule] = [np.asarray(a, np.float32) for a in f(*args)]
        for a, b in zip(got["dynamic"], got["static"]):
            np.testing.assert_array_equal(a, b, err_msg=f"T={T} sizes={sizes}")
        check(*args, activation, 2e-2)


@needs_gpu
def test_kernel_wide_and_reproducible():
    """A Qwen3-like expert (H 2048, F 768), 8 experts of uneven rows: equal to the unfused path
    to rounding, bitwise equal between two calls."""
    args = problem(512, 2048, 768, [500, 0, 129, 1, 1000, 256, 7, 300], "swiglu", jnp.bfloat16)
    f = jax.jit(functools.partial(gather_gemm.gather_gemm, activation="swiglu", save_pre=True))
    out, pre = f(*args)
    out2, pre2 = f(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))
    np.testing.assert_array_equal(np.asarray(pre, np.float32), np.asarray(pre2, np.float32))
    want_out, want_pre = jax.jit(functools.partial(gather_gemm._unfused, activation="swiglu", save_pre=True))(*args)
    scale = float(jnp.abs(want_pre.astype(jnp.float32)).max())
    assert_allclose(pre / scale, want_pre / scale, 1e-2)
    out_scale = float(jnp.abs(want_out.astype(jnp.float32)).max())  # out grows like pre^2 (gate * up)
    assert_allclose(out / out_scale, want_out / out_scale, 2e-2)


def test_layer_mode_variable(monkeypatch):
    """MOE_GATHER_GEMM: "forward" (the default) enables the layer's fused kernel in the forward pass
    only, for groups of 128 to 511 rows on average, and up to 2047 for experts of F <= 4096; "1" in
    both passes at any group size; "0" in neither; anything else is an error naming the variable,
    raised when the layer is traced."""
    monkeypatch.delenv("MOE_GATHER_GEMM", raising=False)
    assert gather_gemm.layer_enabled(False, 256, 768) and not gather_gemm.layer_enabled(True, 256, 768)
    fused = [(128, 14336), (511.9, 14336), (512, 768), (1024, 4096), (2047.9, 2048)]
    unfused = [(0.5, 768), (127.9, 768), (512, 4097), (1024, 14336), (2048, 768), (4096, 14336)]
    for mode, forward, differentiated in (("forward", True, False), ("1", True, True), ("0", False, False)):
        monkeypatch.setenv("MOE_GATHER_GEMM", mode)
        for rows_per_group, ffn in fused:
            assert gather_gemm.layer_enabled(False, rows_per_group, ffn) == forward
            assert gather_gemm.layer_enabled(True, rows_per_group, ffn) == differentiated
        for rows_per_group, ffn in unfused:  # outside the measured range: only when forced
            assert gather_gemm.layer_enabled(False, rows_per_group, ffn) == (mode == "1")
    monkeypatch.setenv("MOE_GATHER_GEMM", "yes")
    with pytest.raises(ValueError, match="MOE_GATHER_GEMM"):
        jmp.moe_mlp(*layer_inputs(8, 4, 2, 16, 8, "swiglu", jnp.float32))


def layer_modes_agree(monkeypatch, f, args, argnums, tol):
    """f on the composition (MOE_GATHER_GEMM=0) against f with the fused kernel in the forward pass
    only (the default) and in both passes ("1"): the kernel is in each lowered program where its mode
    says, and results and gradients agree to rounding."""
    ct = random_float(jax.eval_shape(f, *args).shape, jnp.float32)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
    grad_of = lambda: jax.jit(jax.grad(loss, argnums))  # fresh: the branch is chosen while tracing
    monkeypatch.setenv("MOE_GATHER_GEMM", "0")
    assert TARGET not in lowered_text(f, *args)
    assert TARGET not in grad_of().lower(*args).as_text()
    want = jax.jit(lambda *a: f(*a))(*args).astype(jnp.float32)
    want_grads = grad_of()(*args)
    scale = float(jnp.abs(want).max())
    for mode, in_grad in (("forward", False), ("1", True)):
        monkeypatch.setenv("MOE_GATHER_GEMM", mode)
        assert TARGET in lowered_text(f, *args), mode
        grad = grad_of()
        assert (TARGET in grad.lower(*args).as_text()) == in_grad, mode
        got = jax.jit(lambda *a: f(*a))(*args).astype(jnp.float32)
        assert_allclose(got / scale, want / scale, tol)
        for a, b in zip(grad(*args), want_grads):
            s = max(float(jnp.abs(b.astype(jnp.float32)).max()), 1e-6)
            assert_allclose(a.astype(jnp.float32) / s, b.astype(jnp.float32) / s, tol)


@needs_gpu
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_expert_mlp_uses_kernel(monkeypatch, activation):
    """expert_mlp (moe_ep's expert_fn) applies the activation in the fused kernel's epilogue where
    MOE_GATHER_GEMM enables it (150 rows a group on average: inside the default's range), equal to
    its plain composition to rounding, forward and under jax.grad."""
    rows, sizes, w_in, w_out = expert_mlp_inputs(activation, jnp.bfloat16, R=600, H=128, F=128)
    sizes = jnp.asarray([100, 0, 130, 60], jnp.int32)
    f = lambda r, wi, wo: layer.expert_mlp(r, sizes, wi, wo, activation)
    layer_modes_agree(monkeypatch, f, (rows, w_in, w_out), (0, 1, 2), 2e-2)


@needs_gpu
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_layer_uses_kernel_and_matches_dense(monkeypatch, activation):
    """moe_mlp on kernel-sized experts (128 rows a group on average) takes the fused kernel where
    MOE_GATHER_GEMM enables it, forward and under jax.grad, equal to the composition to rounding
    and to the dense reference."""
    T, E, K, H, F = 256, 8, 4, 128, 128
    x, weights, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation, jnp.bfloat16)
    f = lambda x, w, wi, wo: jmp.moe_mlp(x, w, ids, wi, wo, activation=activation)
    layer_modes_agree(monkeypatch, f, (x, weights, w_in, w_out), (0, 1, 2, 3), 2e-2)
    monkeypatch.delenv("MOE_GATHER_GEMM")
    ref = functools.partial(dense_moe, activation=activation)
    f32 = lambda *a: [b.astype(jnp.float32) for b in a]
    want = ref(*f32(x, weights), ids, *f32(w_in, w_out))
    scale = float(jnp.abs(want).max())
    assert_allclose(jax.jit(f)(x, weights, w_in, w_out) / scale, want / scale, 3e-2)
    ct = random_float((T, H), jnp.float32)
    loss = lambda g: lambda x, w, wi, wo: jnp.sum(g(x, w, wi, wo).astype(jnp.float32) * ct)
    grad = jax.jit(jax.grad(loss(f), (0, 1, 2, 3)))
    ref_ids = lambda x, w, wi, wo: ref(x, w, ids, wi, wo)
    for a, b in zip(grad(x, weights, w_in, w_out), jax.grad(loss(ref_ids), (0, 1, 2, 3))(*f32(x, weights, w_in, w_out))):
        s = max(float(jnp.abs(b).max()), 1e-6)
        assert_allclose(a.astype(jnp.float32) / s, b / s, 3e-2)


# ---- the weight gradient of the gathered rows (gathered_wgrad) ------------------------------

def wgrad_reference(x, row_token, ct, group_sizes):
    """Float32, precision HIGHEST: each group's gathered rows (zero for tokens outside [0, T))
    against its rows of ct; rows past the groups' sum add nothing."""
    rows = np.asarray(gather_gemm.gathered_rows(x.astype(jnp.float32), row_token), np.float32)
    ct = np.asarray(ct, np.float32)
    out, start = [], 0
    for n in np.clip(np.asarray(group_sizes), 0, None):
        end = min(start + int(n), rows.shape[0])
        out.append(jnp.matmul(rows[start:end].T, ct[start:end], precision=jax.lax.Precision.HIGHEST))
        start = end
    return jnp.stack(out)


@pytest.mark.parametrize("T,H,N,sizes,extra", [
    (7, 16, 8, [3, 0, 5, 2], 0), (5, 8, 3, [4], 2), (1, 1, 1, [1, 0], 0), (0, 8, 4, [0, 2], 3),
    (9, 24, 16, [0, 6, 1, 0, 4], 1), (4, 8, 8, [0, 0], 5)])
def test_gathered_wgrad_matches_reference(T, H, N, sizes, extra):
    x, tokens, sizes, _ = problem(T, H, N, sizes, "none", jnp.float32, extra)
    ct = random_float((tokens.shape[0], N), jnp.float32)
    got = jax.jit(gather_gemm.gathered_wgrad)(x, tokens, ct, sizes)
    assert got.shape == (len(sizes), H, N) and got.dtype == x.dtype
    assert_allclose(got, wgrad_reference(x, tokens, ct, sizes), 1e-5)


def test_gathered_wgrad_of_rhs():
    """gather_rhs: rhs's rows read through the index (tokens -1 and T among them), lhs in order."""
    for T, K, N, sizes, extra in ((7, 16, 8, [3, 0, 5, 2], 2), (1, 8, 4, [1, 0], 0), (0, 8, 4, [0, 2], 1)):
        y, tokens, sizes, _ = problem(T, N, N, sizes, "none", jnp.float32, extra)
        lhs = random_float((tokens.shape[0], K), jnp.float32)
        got = jax.jit(functools.partial(gather_gemm.gathered_wgrad, gather_rhs=True))(lhs, tokens, y, sizes)
        rows = gather_gemm.gathered_rows(y, tokens)
        want = jnp.transpose(wgrad_reference(rows, jnp.arange(rows.shape[0]), lhs, sizes), (0, 2, 1))
        assert got.shape == (len(sizes), K, N)
        assert_allclose(got, want, 1e-5)


def test_gather_gemm_transposes():
    """gather_gemm with activation "none" is linear in w and in x: its transposes are
    gathered_wgrad and the composition's; with another activation there is none."""
    x, tokens, sizes, w = problem(9, 16, 8, [3, 0, 5, 2], "none", jnp.float32, 2)
    ct = random_float((tokens.shape[0], 8), jnp.float32)
    of_w = jax.linear_transpose(lambda w: gather_gemm.gather_gemm(x, tokens, sizes, w, activation="none")[0], w)
    assert_allclose(jax.jit(of_w)(ct)[0], wgrad_reference(x, tokens, ct, sizes), 1e-5)
    of_x = jax.linear_transpose(lambda x: gather_gemm.gather_gemm(x, tokens, sizes, w, activation="none")[0], x)
    want = jax.vjp(lambda x: reference(x, tokens, sizes, w, "none")[0], x)[1](ct)[0]
    assert_allclose(jax.jit(of_x)(ct)[0], want, 1e-5)
    with pytest.raises(NotImplementedError, match="linear"):
        jax.linear_transpose(lambda w: gather_gemm.gather_gemm(x, tokens, sizes, w, activation="relu")[0], w)(ct)


def test_gathered_wgrad_vmap_and_jvp():
    x, tokens, sizes, _ = problem(6, 8, 4, [2, 3, 4], "none", jnp.float32)
    ct = random_float((tokens.shape[0], 4), jnp.float32)
    xs = jnp.stack([x, random_float(x.shape, x.dtype)])
    outs = jax.jit(jax.vmap(gather_gemm.gathered_wgrad, (0, None, None, None)))(xs, tokens, ct, sizes)
    for v in range(2):
        assert_allclose(outs[v], wgrad_reference(xs[v], tokens, ct, sizes), 1e-5)
    dx, dct = random_float(x.shape, x.dtype), random_float(ct.shape, ct.dtype)
    f = lambda x, ct: gather_gemm.gathered_wgrad(x, tokens, ct, sizes)
    g = lambda x, ct: jnp.stack([gather_gemm.gathered_rows(x, tokens)[a:b].T @ ct[a:b]
                                 for a, b in ((0, 2), (2, 5), (5, 9))])
    for got, want in zip(jax.jvp(f, (x, ct), (dx, dct)), jax.jvp(g, (x, ct), (dx, dct))):
        assert_allclose(got, want, 1e-5)


def test_gathered_wgrad_mode_variable(monkeypatch):
    """MOE_GATHERED_WGRAD: off ("0") or where no kernel runs, the layer keeps the plain weight
    gradient; anything but preferred / 1 / 0 is an error naming the variable."""
    x, w_in = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((8, 128, 256), jnp.bfloat16)
    monkeypatch.setenv("MOE_GATHERED_WGRAD", "0")
    assert not gather_gemm.layer_gathers_wgrad(x, w_in, 1024, "swiglu")
    monkeypatch.setenv("MOE_GATHERED_WGRAD", "1")
    fits = gather_gemm.gathered_wgrad_kernel_fits(x, 1024, 128, 256, 8)
    assert gather_gemm.layer_gathers_wgrad(x, w_in, 1024, "swiglu") == fits
    monkeypatch.setenv("MOE_GATHERED_WGRAD", "preferred")
    assert gather_gemm.layer_gathers_wgrad(x, w_in, 1024, "swiglu") == fits  # 128 rows a group
    monkeypatch.setenv("MOE_GATHERED_WGRAD", "always")
    with pytest.raises(ValueError, match="MOE_GATHERED_WGRAD"):
        gather_gemm.layer_gathers_wgrad(x, w_in, 1024, "swiglu")


@pytest.mark.parametrize("fused_forward", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_layer_gathered_wgrad_matches_dense(monkeypatch, activation, fused_forward):
    """The layer's backward with the first GEMM's weight gradient read through the row -> token
    index, forced where the kernel does not run (the primitive's composition): after the plain
    forward or the gathered one, gradients of every argument equal the dense MoE's, and forward-mode
    derivatives too."""
    monkeypatch.setattr(gather_gemm, "layer_gathers_wgrad", lambda *a: True)
    monkeypatch.setattr(layer, "gathers_rows", lambda *a, **k: fused_forward)
    T, E, K, H, F = 13, 6, 3, 8, 5
    x, weights, ids, w_in, w_out = layer_inputs(T, E, K, H, F, activation)
    ids = ids.at[0, 0].set(-1).at[1, 1].set(E).at[2, 2].set(ids[2, 1])
    ours = lambda x, w, wi, wo: jmp.moe_mlp(x, w, ids, wi, wo, activation=activation)
    ref = lambda x, w, wi, wo: dense_moe(x, w, ids, wi, wo, activation)
    ct = random_float((T, H), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    grad = jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))
    assert "gathered_wgrad" in str(jax.make_jaxpr(jax.grad(loss(ours), (0, 1, 2, 3)))(x, weights, w_in, w_out))
    for a, b in zip(grad(x, weights, w_in, w_out), jax.grad(loss(ref), (0, 1, 2, 3))(x, weights, w_in, w_out)):
        assert_allclose(a, b, 1e-4)
    primals = (x, weights, w_in, w_out)
    tangents = tuple(random_float(a.shape, a.dtype) for a in primals)
    for a, b in zip(jax.jvp(ours, primals, tangents), jax.jvp(ref, primals, tangents)):
        assert_allclose(a, b, 1e-4)


WGRAD_TARGET = "jax_moe_permute.gathered_wgrad_sm90"


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gathered_wgrad_kernel(monkeypatch, dtype):
    """The kernel (gathered lhs of cpp/gemm/grouped_wgrad.cu) against the float32 reference, and
    bitwise equal to the same kernel on the rows gathered first (the same products in the same
    order): groups empty, of one row, around the 64-row stage and the 128 x 256 tile, rows past the
    sum, tokens -1 and T, K = H over several tiles and N with a partial 256-column tile."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "persistent")
    H, N = 192, 320
    for sizes in GPU_SIZES:
        x, tokens, sizes, _ = problem(97, H, N, sizes, "none", dtype, extra_rows=5)
        ct = random_float((tokens.shape[0], N), dtype)
        assert gather_gemm.gathered_wgrad_kernel_fits(x, tokens.shape[0], H, N, len(sizes))
        assert WGRAD_TARGET in lowered_text(gather_gemm.gathered_wgrad, x, tokens, ct, sizes)
        got = jax.jit(gather_gemm.gathered_wgrad)(x, tokens, ct, sizes)
        want = wgrad_reference(x, tokens, ct, sizes)
        scale = max(float(jnp.abs(want).max()), 1.0)
        assert_allclose(got.astype(jnp.float32) / scale, want / scale, 2e-2)
        w_aval = jax.ShapeDtypeStruct((len(sizes), H, N), dtype)
        plain = jax.jit(lambda x, t, c, s: jax.linear_transpose(
            lambda w: jmp.ragged_dot(gather_gemm.gathered_rows(x, t), w, s), w_aval)(c)[0])
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain(x, tokens, ct, sizes), np.float32))


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gathered_wgrad_kernel_of_rhs(monkeypatch, dtype):
    """The kernel with rhs gathered (the second GEMM's dW reading the output's cotangent) against
    the float32 reference and bitwise equal to the plain kernel on the gathered rows."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_DW_KERNEL", "persistent")
    K, N = 320, 192
    for sizes in GPU_SIZES:
        y, tokens, sizes, _ = problem(97, N, N, sizes, "none", dtype, extra_rows=5)
        lhs = random_float((tokens.shape[0], K), dtype)
        f = jax.jit(functools.partial(gather_gemm.gathered_wgrad, gather_rhs=True))
        assert WGRAD_TARGET in f.lower(lhs, tokens, y, sizes).as_text()
        got = f(lhs, tokens, y, sizes)
        rows = gather_gemm.gathered_rows(y, tokens)
        want = jnp.transpose(wgrad_reference(rows, jnp.arange(rows.shape[0]), lhs, sizes), (0, 2, 1))
        scale = max(float(jnp.abs(want).max()), 1.0)
        assert_allclose(got.astype(jnp.float32) / scale, want / scale, 2e-2)
        w_aval = jax.ShapeDtypeStruct((len(sizes), K, N), dtype)
        plain = jax.jit(lambda a, r, s: jax.linear_transpose(lambda w: jmp.ragged_dot(a, w, s), w_aval)(r)[0])
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain(lhs, rows, sizes), np.float32))


@needs_gpu
def test_layer_backward_takes_gathered_wgrad(monkeypatch):
    """jit(grad) of moe_mlp at fine-grained sizes reads x's rows in the first weight gradient (the
    default), and its gradients equal those with the rows gathered again (MOE_GATHERED_WGRAD=0).
    The second GEMM's backward keeps its composition here: its gathered form (MOE_DOWN_BACKWARD's
    default at these sizes) reads ct's rows with the same kernel."""
    monkeypatch.setenv("MOE_DOWN_BACKWARD", "composition")
    T, E, K, H, F = 512, 16, 4, 128, 128
    x, weights, ids, w_in, w_out = layer_inputs(T, E, K, H, F, "swiglu", jnp.bfloat16)
    ct = random_float((T, H), jnp.float32)
    loss = lambda x, w, wi, wo: jnp.sum(jmp.moe_mlp(x, w, ids, wi, wo).astype(jnp.float32) * ct)
    grads = {}
    for mode in ("preferred", "0"):
        monkeypatch.setenv("MOE_GATHERED_WGRAD", mode)
        grad = jax.jit(jax.grad(loss, (0, 1, 2, 3)))
        assert (WGRAD_TARGET in grad.lower(x, weights, w_in, w_out).as_text()) == (mode == "preferred")
        grads[mode] = grad(x, weights, w_in, w_out)
    for a, b in zip(grads["preferred"], grads["0"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
