"""moe_mlp (its JVP rule: x, the routing and gate|up saved) against the plain composition under
autodiff, in the same run: forward and jit(grad) CUPTI time, compiled temp memory, gradient
agreement (GPU only):

    python benchmarks/micro/jvp_rule_ab.py T [OUT.txt]
"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
from jax_moe_permute import layer, routing
from jax_moe_permute.bench_layer import MODELS  # name: (E, K, H, F)

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
LOG = open(sys.argv[2], "a") if len(sys.argv) > 2 else sys.stdout


def med(f, *a):
    _, ms = profiler.measure(jax.jit(f), iterations=10)(*a)
    return float(np.median(ms)) * 1e3


for name in ("qwen3", "mixtral", "deepseek"):
    E, K, H, F = MODELS[name]
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    logits = jax.random.normal(ks[1], (T, E), jnp.float32)
    r = routing.route(logits, K)
    w_in = (jax.random.normal(ks[2], (E, H, 2 * F), jnp.bfloat16) * H ** -0.5).astype(jnp.bfloat16)
    w_out = (jax.random.normal(ks[3], (E, F, H), jnp.bfloat16) * F ** -0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(ks[4], (T, H), jnp.bfloat16)
    new = lambda x, w, wi, wo: layer.moe_mlp(x, w, r.ids, wi, wo)
    old = lambda x, w, wi, wo: layer._routed_experts.fun(x, w, r.ids, wi, wo, None, "swiglu", E, None)
    loss = lambda f: (lambda *a: jnp.vdot(f(*a).astype(jnp.float32), ct.astype(jnp.float32)))
    args = (x, r.weights, w_in, w_out)
    g_new = jax.grad(loss(new), argnums=(0, 1, 2, 3))
    g_old = jax.grad(loss(old), argnums=(0, 1, 2, 3))
    a, b = jax.jit(g_new)(*args), jax.jit(g_old)(*args)
    errs = [float(jnp.max(jnp.abs(u - v))) / (float(jnp.max(jnp.abs(v))) + 1e-30) for u, v in zip(a, b)]
    del a, b
    t_fwd = med(new, *args)
    t_new, t_old = med(g_new, *args), med(g_old, *args)
    mem = {}
    for tag, g in (("new", g_new), ("old", g_old)):
        ma = jax.jit(g).lower(*args).compile().memory_analysis()
        mem[tag] = getattr(ma, "temp_size_in_bytes", -1) / 2**20
    print(f"{name} T={T}: fwd {t_fwd:.0f} us; jit(grad) new {t_new:.0f} us, old {t_old:.0f} us, "
          f"new/old {t_new / t_old:.3f}; temp MiB new {mem['new']:.0f} old {mem['old']:.0f}; "
          f"grad rel err vs old {['%.1e' % e for e in errs]}", file=LOG, flush=True)
    del w_in, w_out
