"""Runs the fused first GEMM (gather_gemm, swiglu) at Qwen3-30B-A3B's shapes, T = 4096, three
times, untimed: a target for `ncu`. Group sizes: uniform (256 rows each), routed (`route` of
random logits), alt (240 and 272 rows alternating) or randtok (256 rows each, random tokens).

    ncu --clock-control none -k regex:gather_gemm --launch-skip 1 --launch-count 1 \
        --metrics dram__bytes_read.sum python benchmarks/micro/gather_gemm_target.py routed
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_permute import gather_gemm, layer, routing
from jax_moe_permute.bench_layer import MODELS

mode = sys.argv[1]
T = 4096
E, K, H, F = MODELS["qwen3"]
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
w_in = (jax.random.normal(ks[2], (E, H, 2 * F), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
if mode == "uniform":
    ids = (jnp.arange(T * K, dtype=jnp.int32) % E).reshape(T, K)
elif mode == "routed":
    ids = routing.route(jax.random.normal(ks[1], (T, E), jnp.float32), K).ids
elif mode == "randtok":  # uniform sizes, random tokens per expert
    perm = jax.random.permutation(ks[3], T * K)
    ids = (perm % E).astype(jnp.int32).reshape(T, K)
elif mode == "alt":  # sizes 240 / 272 alternating (routed-like tile counts), random tokens
    counts = np.where(np.arange(E) % 2 == 0, 240, 272)
    slots = np.random.default_rng(0).permutation(np.repeat(np.arange(E), counts))
    ids = jnp.asarray(slots.reshape(T, K), jnp.int32)
f = jax.jit(lambda x, ids, w: gather_gemm.gather_gemm(x, *layer.routing_rows(x, ids, E)[:2], w, activation="swiglu")[0])
sizes = np.bincount(np.asarray(ids).ravel(), minlength=E)
print(mode, "sizes min/mean/max", sizes.min(), sizes.mean(), sizes.max(), "row tiles", int(np.ceil(sizes / 128).sum()))
for _ in range(3):
    jax.block_until_ready(f(x, ids, w_in))
