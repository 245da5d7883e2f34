"""One MoE block at decode sizes, x + moe_mlp(x, route_tokens(x, router)): the fused decode MLP
and router (product and choice in one launch) against route(router_logits(x, router)) with the fused
MLP, and against the unfused composition (permute, the decode GEMM kernel, SwiGLU, unpermute), in
the same run, median CUPTI time of 20 calls and each kernel's time (GPU only):

    python benchmarks/micro/decode_layer_split.py qwen3,mixtral,deepseek 1,2,4   (T > 1: Qwen3 only)

The decode MLP's second launch is a programmatic dependent launch: its CUPTI time includes its
wait for the first; JAX_MOE_PERMUTE_DECODE_PDL=0 gives each kernel's own time.
"""
import sys, collections
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
from jax_moe_permute import layer, routing
from jax_moe_permute.bench_layer import MODELS  # name: (E, K, H, F)

for name in sys.argv[1].split(","):
    E, K, H, F = MODELS[name]
    for T in [int(t) for t in sys.argv[2].split(",")]:
        if name != "qwen3" and T > 1: continue
        ks = jax.random.split(jax.random.key(1), 5)
        x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
        router = (jax.random.normal(ks[1], (H, E), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
        w_in = (jax.random.normal(ks[2], (E, H, 2 * F), jnp.bfloat16) * H ** -0.5).astype(jnp.bfloat16)
        w_out = (jax.random.normal(ks[3], (E, F, H), jnp.bfloat16) * F ** -0.5).astype(jnp.bfloat16)

        def block(mlp, fused_router=True):
            def f(x, router, w_in, w_out):
                r = (routing.route_tokens(x, router, K) if fused_router
                     else routing.route(layer.router_logits(x, router), K))
                return x + mlp(x, r.weights, r.ids, w_in, w_out)
            return f
        fused = block(layer.moe_mlp)
        unfused = block(lambda x, w, i, wi, wo: layer.unfused_routed_experts(x, w, i, wi, wo, "swiglu"), False)
        args = (x, router, w_in, w_out)
        a = jax.jit(fused)(*args); b = jax.jit(unfused)(*args)
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        routed = len(set(np.asarray(routing.route(layer.router_logits(x, router), K).ids).ravel().tolist()))
        wbytes = routed * 3 * H * F * 2
        for tag, f in (("fused", fused), ("fused_mlp_xla_router", block(layer.moe_mlp, False)), ("unfused", unfused)):
            _, per = profiler.measure(jax.jit(f), aggregate=False, iterations=20)(*args)
            totals = [sum(t for _, t in it) for it in per]
            i = int(np.argsort(totals)[len(totals) // 2])
            med = totals[i] * 1e3
            kernels = ", ".join(f"{n[:28]} {t * 1e3:.1f}" for n, t in per[i])
            print(f"{name} T={T} {tag}: {med:.1f} us (weights {wbytes / 1e6:.1f} MB: {wbytes / med / 1e6:.2f} TB/s); "
                  f"max |fused - unfused| {err:.3g}; {kernels}", flush=True)
        del w_in, w_out
