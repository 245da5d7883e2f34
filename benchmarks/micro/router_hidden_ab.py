"""route_tokens' fused router kernel (forced wherever it fits) against route(router_logits(x,
router)), CUPTI device time of the pair (weights, ids) per (T, H, E), bf16, to set the lowering's
rule in jax_moe_permute/router_kernel.py (GPU only):

    python benchmarks/micro/router_hidden_ab.py [TOKENS] [SHAPES]   (TOKENS e.g. 1,2,4,8; SHAPES models|small)

models: the routers of Qwen3-30B, Qwen3-235B, gpt-oss, Mixtral, DeepSeek-V3 and a few between;
small: 16-32 experts. Raw output in benchmarks/results/logs/router-hidden-ab-h200.txt.
"""
import sys

import jax
import jax.numpy as jnp

from jax_moe_permute import _native, route, route_tokens, router_kernel
from jax_moe_permute.bench_timing import device_us

DEEPSEEK = dict(scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5)
SHAPES = {  # (H, E, K, route's keywords)
    "models": [(2048, 128, 8, {}), (4096, 128, 8, {}), (2880, 128, 4, {}), (4096, 8, 2, {}), (4096, 64, 8, {}),
               (7168, 64, 8, {}), (7168, 128, 8, {}), (5120, 160, 6, {}), (7168, 256, 8, DEEPSEEK)],
    "small": [(2048, 128, 8, {}), (2048, 16, 2, {}), (2048, 32, 4, {}), (4096, 32, 4, {}), (4096, 16, 2, {})],
}


def main(tokens=(1, 8), shapes="models"):
    key = jax.random.PRNGKey(0)
    for T in tokens:
        for H, E, K, kw in SHAPES[shapes]:
            x = jax.random.normal(key, (T, H), jnp.bfloat16)
            r = (jax.random.normal(jax.random.fold_in(key, 1), (H, E), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
            fused = jax.jit(lambda x, r: route_tokens(x, r, K, **kw)[:2])
            composition = jax.jit(lambda x, r: route(router_kernel.router_logits(x, r), K, **kw)[:2])
            with router_kernel.hidden_kernel_wherever_it_fits():
                fused = fused.lower(x, r).compile()
            assert _native.target("router_hidden") in fused.as_text()
            a, b = device_us(fused, x, r, iterations=50), device_us(composition, x, r, iterations=50)
            print(f"T={T} H={H} E={E} K={K} router {H * E * 2 / 2 ** 20:.2f} MiB: fused {a:.2f} us, "
                  f"composition {b:.2f} us, ratio {a / b:.2f}", flush=True)


if __name__ == "__main__":
    main(tuple(map(int, sys.argv[1].split(","))) if len(sys.argv) > 1 else (1, 8),
         sys.argv[2] if len(sys.argv) > 2 else "models")
