"""The fused first GEMM (gather_gemm: rows gathered from x, activation in the epilogue) against what
it replaces (moe_permute + ragged_dot + swiglu) and a dense GEMM of the same FLOPs, then the whole
moe_mlp layer with and without it, forward and jit(grad); CUPTI device time, one run (GPU only):

    python benchmarks/micro/gather_gemm_ab.py [T] [OUT.txt] [MODELS, e.g. qwen3,deepseek]
"""
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_moe_permute import gather_gemm, layer, ops, routing
from jax_moe_permute.bench_layer import MODELS  # name: (E, K, H, F)
from jax_moe_permute.grouped_gemm import ragged_dot

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
LOG = open(sys.argv[2], "a") if len(sys.argv) > 2 and sys.argv[2] != "-" else sys.stdout
NAMES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["qwen3", "deepseek", "mixtral"]


def med(f, *a):
    _, ms = profiler.measure(jax.jit(f), iterations=10)(*a)
    return float(np.median(ms)) * 1e3


def unfused_first_gemm(x, ids, w_in, E):
    res = ops.moe_permute(x, ids, E)
    return layer.apply_activation(ragged_dot(res.hidden, w_in, res.group_sizes), "swiglu")


def fused_first_gemm(x, ids, w_in, E, save_pre=False):
    row_token, sizes, _ = layer.routing_rows(x, ids, E)
    out, pre = gather_gemm.gather_gemm(x, row_token, sizes, w_in, activation="swiglu", save_pre=save_pre)
    return out if pre is None else (out, pre)


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


for name in NAMES:
    E, K, H, F = MODELS[name]
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    w_in = (jax.random.normal(ks[2], (E, H, 2 * F), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
    w_out = (jax.random.normal(ks[3], (E, F, H), jnp.float32) * F ** -0.5).astype(jnp.bfloat16)
    dense_a = jax.random.normal(ks[4], (T * K, H), jnp.bfloat16)
    dense_b = w_in[0]
    flop = 2.0 * T * K * H * 2 * F
    t_dense = med(jnp.dot, dense_a, dense_b)
    uniform = (jnp.arange(T * K, dtype=jnp.int32) % E).reshape(T, K)
    r = routing.route(jax.random.normal(ks[1], (T, E), jnp.float32), K)
    for routing_name, ids in (("uniform", uniform), ("routed", r.ids)):
        fused = functools.partial(fused_first_gemm, E=E)
        unfused = functools.partial(unfused_first_gemm, E=E)
        err = rel_err(jax.jit(fused)(x, ids, w_in), jax.jit(unfused)(x, ids, w_in))
        # The kernel reads its tile schedule at every launch: the static one timed on the same jit.
        os.environ["MOE_GATHER_GEMM_SCHEDULE"] = "static"
        t_static = med(fused, x, ids, w_in)
        os.environ["MOE_GATHER_GEMM_SCHEDULE"] = gather_gemm.SCHEDULES[0]
        t_f, t_fp, t_u = med(fused, x, ids, w_in), med(functools.partial(fused, save_pre=True), x, ids, w_in), \
            med(unfused, x, ids, w_in)
        print(f"{name} T={T} {routing_name}: first GEMM fused {t_f:.1f} us ({flop / t_f / 1e6:.0f} TFLOP/s; "
              f"static schedule {t_static:.1f}), "
              f"fused+pre {t_fp:.1f}, permute+ragged_dot+swiglu {t_u:.1f} (fused x{t_u / t_f:.2f}); "
              f"dense {t_dense:.1f} ({flop / t_dense / 1e6:.0f} TFLOP/s, fused/dense {t_dense / t_f:.2f}); "
              f"max rel diff {err:.1e}", file=LOG, flush=True)

    # The layer: moe_mlp with the rows gathered in its first GEMM (and the activation in its
    # epilogue) against the same call on the permute -> ragged_dot -> activation composition.
    ct = jax.random.normal(ks[5], (T, H), jnp.bfloat16).astype(jnp.float32)
    args = (x, r.weights, w_in, w_out)
    times, results = {}, {}
    for tag, on in (("gather", "1"), ("unfused", "0")):
        # Fresh functions per tag: jit caches its trace on the function object, and the branch is
        # chosen (MOE_GATHER_GEMM) while tracing.
        layer_fn = lambda x, w, wi, wo: layer.moe_mlp(x, w, r.ids, wi, wo)
        grad = jax.grad(lambda x, w, wi, wo: jnp.vdot(layer_fn(x, w, wi, wo).astype(jnp.float32), ct),
                        argnums=(0, 1, 2, 3))
        os.environ["MOE_GATHER_GEMM"] = on
        jax.clear_caches()
        try:
            # Each program must run the branch its tag names (H100 runs of this script once gave
            # bitwise equal results for both tags).
            for f in (layer_fn, grad):
                hlo = jax.jit(f).lower(*args).as_text()
                assert ("jax_moe_permute.gather_gemm" in hlo) == (on == "1"), (tag, "gather_gemm")
            results[tag] = (jax.jit(layer_fn)(*args), jax.jit(grad)(*args))
            times[tag] = (med(layer_fn, *args), med(grad, *args))
        finally:
            os.environ.pop("MOE_GATHER_GEMM")
    errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(results["gather"]), jax.tree.leaves(results["unfused"]))]
    (g_fwd, g_bwd), (u_fwd, u_bwd) = times["gather"], times["unfused"]
    print(f"{name} T={T} layer (routed): fwd gather {g_fwd:.0f} us / unfused {u_fwd:.0f} (x{u_fwd / g_fwd:.3f}); "
          f"jit(grad) gather {g_bwd:.0f} / unfused {u_bwd:.0f} (x{u_bwd / g_bwd:.3f}); max rel diff {max(errs):.1e}",
          file=LOG, flush=True)
    del w_in, w_out, dense_a, results
