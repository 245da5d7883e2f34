"""Sharded jax.jit: the leading batch axis that vmap adds partitions over the devices (each one
runs the kernels on its own slice, no collective, outputs keep the sharding); any other
sharding gives the same result as one device. Runs on 4 CPU devices in a subprocess, since
the device count is fixed when jax starts."""

import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_moe_permute as jmp

    B, T, K, H, E = 8, 24, 2, 16, 6
    mesh = jax.make_mesh((4,), ("d",))
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    hidden = jax.random.normal(keys[0], (B, T, H), jnp.float32)
    ids = jax.random.randint(keys[1], (B, T, K), -1, E + 1)
    weights = jax.random.uniform(keys[2], (B, T, K), jnp.float32)

    def layer(h, i, w):
        res = jmp.moe_permute(h, i, E, align_size=4)
        return jmp.moe_unpermute(res.hidden * 2.0, res.row_map, w)

    def loss(h, w):
        return jnp.sum(jax.vmap(layer)(h, ids_sharded, w) ** 2)

    want = jax.jit(jax.vmap(layer))(hidden, ids, weights)
    want_grad = jax.jit(jax.grad(lambda h, w: jnp.sum(jax.vmap(layer)(h, ids, w) ** 2), argnums=(0, 1)))(hidden, weights)

    batch = NamedSharding(mesh, P("d"))
    h_s, ids_sharded, w_s = (jax.device_put(a, batch) for a in (hidden, ids, weights))
    fwd = jax.jit(jax.vmap(layer))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for name, fn, args in [("forward", fwd, (h_s, ids_sharded, w_s)), ("grad", grad, (h_s, w_s))]:
        text = fn.lower(*args).compile().as_text()
        for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
            print(name, collective, collective in text)
        outs = jax.tree.leaves(fn(*args))
        print(name, "sharded", all(o.sharding.is_equivalent_to(batch, o.ndim) for o in outs))
    np.testing.assert_allclose(fwd(h_s, ids_sharded, w_s), want, rtol=1e-6, atol=1e-6)
    for g, w in zip(grad(h_s, w_s), want_grad):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    # Other axes sharded: the same values (the op gathers what it needs).
    for spec in (P(None, "d"), P(None, None, "d")):
        h_o = jax.device_put(hidden, NamedSharding(mesh, spec))
        np.testing.assert_allclose(jax.jit(jax.vmap(layer))(h_o, ids, weights), want, rtol=1e-6, atol=1e-6)
    print("values ok")
""")


def run_on_four_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def test_batch_axis_partitions_without_collectives():
    lines = run_on_four_devices()
    assert "values ok" in lines
    for name in ("forward", "grad"):
        for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
            assert f"{name} {collective} False" in lines, (name, collective, lines)
        assert f"{name} sharded True" in lines, lines
