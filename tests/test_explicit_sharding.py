"""Explicit sharding (sharding in types; `jax.make_mesh`'s default axis type): every public op
runs on arrays sharded along Explicit mesh axes, gives the single-device values, returns its
batch axis (vmap's) as sharded as its operands' and every other axis replicated (moe_mlp: in
x's sharding, and with the tokens split it runs data parallel), and derivatives come back in
their primals' shardings. Runs on 4 CPU devices in
a subprocess, since the device count is fixed when jax starts."""

import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jax_moe_permute as jmp

    T, H, F, E, K = 24, 16, 8, 8, 2
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    x = jax.random.normal(keys[0], (T, H), jnp.float32)
    router = jax.random.normal(keys[1], (H, E), jnp.float32)
    w_in = jax.random.normal(keys[2], (E, H, 2 * F), jnp.float32) * 0.3
    w_out = jax.random.normal(keys[3], (E, F, H), jnp.float32) * 0.3
    rows = jax.random.normal(keys[4], (T * K, H), jnp.float32)
    sizes = jnp.array([5, 0, 9, 3, 7, 11, 6, 7], jnp.int32)
    batch = jax.random.normal(keys[5], (4, T * K, H), jnp.float32)

    def layer(x, router, w_in, w_out):
        r = jmp.route_tokens(x, router, K)
        y = jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out)
        return y, r.aux.load_balance_loss

    def loss(*args):
        y, balance = layer(*args)
        return jnp.sum(y ** 2) + balance

    def gemms(rows, w, batch):
        return jmp.ragged_dot(rows, w, sizes), jax.vmap(lambda a: jmp.ragged_dot(a, w, sizes))(batch)

    # Mixed dtypes go to jax.lax.ragged_dot itself: forward only, as its derivative rules drop
    # the out_sharding an explicit mesh asks for.
    def mixed(rows, w):
        return jmp.ragged_dot(rows, w.astype(jnp.bfloat16), sizes, preferred_element_type=jnp.float32)

    def gemm_loss(rows, w, batch):
        return sum(jnp.sum(y ** 2) for y in gemms(rows, w, batch))

    args = (x, router, w_in, w_out)
    want = jax.jit(layer)(*args)
    want_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    gemm_args = (rows, w_in, batch)
    want_gemm = jax.jit(gemms)(*gemm_args)
    want_mixed = jax.jit(mixed)(rows, w_in)
    rounding = jax.jit(lambda logits: jmp.route(logits, K, token_rounding=jmp.TokenRounding(tile=4))[:2])
    logits = x @ router
    want_rounding = rounding(logits)
    want_gemm_grad = jax.jit(jax.grad(gemm_loss, argnums=(0, 1, 2)))(*gemm_args)

    def close(got, want, tol):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)

    def specs(tree):
        return [tuple(jax.typeof(a).sharding.spec) for a in jax.tree.leaves(tree)]

    def collectives(fn, *args):
        text = jax.jit(fn).lower(*args).compile().as_text()
        return sorted({c for c in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
                       if c in text})

    r = jmp.route_tokens(x, router, K)
    mlp = lambda x, weights, ids, w_in, w_out: jmp.moe_mlp(x, weights, ids, w_in, w_out)
    mlp_loss = lambda *args: jnp.sum(mlp(*args) ** 2)

    with jax.set_mesh(mesh):
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
        cases = {"tokens": (put(x, P("d")), router, w_in, w_out),
                 "experts": (x, router, put(w_in, P("d")), put(w_out, P("d"))),
                 "hidden": (put(x, P(None, "d")), put(router, P("d")), w_in, w_out)}
        for name, sharded in cases.items():
            got = jax.jit(layer)(*sharded)
            close(got, want, 1e-5)
            print(name, "output like x", specs(got[0]) == specs(sharded[0]))
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*sharded)
            close(grads, want_grad, 1e-4)
            print(name, "grads like primals", specs(grads) == specs(sharded))

        # Tokens split, weights replicated: data parallel, each device its own tokens; the weight
        # gradients summed over the devices.
        routed = [put(a, P("d")) for a in (x, r.weights, r.ids)]
        close(jax.jit(mlp)(*routed, w_in, w_out), want[0], 1e-5)
        close(jax.jit(mlp)(routed[0], r.weights, r.ids, w_in, w_out), want[0], 1e-5)  # gates made off the mesh
        print("data parallel forward", collectives(mlp, *routed, w_in, w_out))
        print("data parallel backward", collectives(jax.grad(mlp_loss, argnums=(0, 3, 4)), *routed, w_in, w_out))

        sharded = (put(rows, P("d")), put(w_in, P("d")), put(batch, P("d")))
        got = jax.jit(gemms)(*sharded)
        close(got, want_gemm, 1e-5)
        print("gemm specs", specs(got) == [(None, None), ("d", None, None)])
        got = jax.jit(mixed)(*sharded[:2])
        close(got, want_mixed, 1e-5)
        print("mixed specs", specs(got) == [(None, None)])
        grads = jax.jit(jax.grad(gemm_loss, argnums=(0, 1, 2)))(*sharded)
        close(grads, want_gemm_grad, 1e-4)
        print("gemm grads like primals", specs(grads) == specs(sharded))

        got = rounding(put(logits, P("d")))
        close(got, want_rounding, 1e-6)
        print("rounding like logits", specs(got) == [("d", None)] * 2)

        from flax import nnx
        from jax_moe_permute.nnx import MoE
        moe = MoE(H, F, E, K, rngs=nnx.Rngs(0))
        want_moe = moe(x)
        got = nnx.jit(lambda m, a: m(a))(moe, put(x, P("d")))
        close(got, want_moe, 1e-5)
        print("nnx output like x", specs(got) == [("d", None)])
    print("values ok")
""")


def test_explicit_axes():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "values ok" in lines, lines
    for name in ("tokens", "experts", "hidden"):
        assert f"{name} output like x True" in lines, lines
        assert f"{name} grads like primals True" in lines, lines
    assert "data parallel forward []" in lines, lines
    assert "data parallel backward ['all-reduce']" in lines, lines
    for line in ("gemm specs True", "mixed specs True", "gemm grads like primals True", "rounding like logits True",
                 "nnx output like x True"):
        assert line in lines, lines
