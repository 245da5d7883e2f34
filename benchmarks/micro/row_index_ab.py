"""The layer's row index (`layer.routing_rows`: the permute of one float32 column, a thread per
entry) against permutes whose rows take a block per token (10-byte rows) and the full permute, at
the layer bench's shapes; CUPTI device time, one run (GPU only):

    python benchmarks/micro/row_index_ab.py [TOKENS, e.g. 4096,16384] [MODELS, e.g. qwen3,deepseek]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_moe_permute import layer, ops, routing
from jax_moe_permute.bench_layer import MODELS  # name: (E, K, H, F)

TOKENS = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4096, 16384]
NAMES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["qwen3", "deepseek", "mixtral"]


def med(f, *a):
    _, ms = profiler.measure(jax.jit(f), iterations=20)(*a)
    return float(np.median(ms)) * 1e3


print(f"{jax.devices()[0].device_kind}; us, CUPTI kernel-time sum, median of 20")
print(f"{'model':9} {'T':>6} {'row index':>10} {'permute 10 B rows':>18} {'permute 16 B rows':>18} {'permute H':>10}")
for name in NAMES:
    E, K, H, _ = MODELS[name]
    for T in TOKENS:
        kx, kr = jax.random.split(jax.random.key(T))
        x = jax.random.normal(kx, (T, H), jnp.bfloat16)
        ids = routing.route(jax.random.normal(kr, (T, E), jnp.float32), K).ids
        permute = lambda h, i: ops.moe_permute(h, i, E).hidden
        t_index = med(lambda x, i: layer.routing_rows(x, i, E)[0], x, ids)
        t_10 = med(permute, x[:, :5], ids)
        t_16 = med(permute, x[:, :8], ids)
        t_full = med(permute, x, ids)
        print(f"{name:9} {T:>6} {t_index:>10.1f} {t_10:>18.1f} {t_16:>18.1f} {t_full:>10.1f}", flush=True)
