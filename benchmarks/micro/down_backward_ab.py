"""The backward of the layer's second half (MOE_DOWN_BACKWARD): the plain tangent transposed op by
op against down_backward.py's primitive, whose transpose runs it in one pass. One moe_mlp layer's
jit(grad) (x, gates, both weights) per model, CUPTI device time, one run (GPU only):

    python benchmarks/micro/down_backward_ab.py [T] [OUT.txt] [MODELS, e.g. qwen3,mixtral]
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_moe_permute import down_backward, layer
from jax_moe_permute.bench_layer import MODELS, layer_inputs, layer_route

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
LOG = open(sys.argv[2], "a") if len(sys.argv) > 2 and sys.argv[2] != "-" else sys.stdout
NAMES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["qwen3"]

for name in NAMES:
    K = MODELS[name][1]
    inputs = layer_inputs(name, T)  # the layer bench's inputs and routing
    x, w_in, w_out, ct = inputs["x"], inputs["w_in"], inputs["w_out"], inputs["ct"]
    r = layer_route(x, inputs["router"], K)
    loss = lambda x, w, wi, wo: jnp.vdot(layer.moe_mlp(x, w, r.ids, wi, wo).astype(jnp.float32), ct)
    times, grads = {}, {}
    for mode in down_backward.MODES:  # read when the layer is traced: a fresh jit per mode
        os.environ["MOE_DOWN_BACKWARD"] = mode
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        grads[mode] = g(x, r.weights, w_in, w_out)
        _, ms = profiler.measure(g, iterations=10)(x, r.weights, w_in, w_out)
        times[mode] = float(np.median(ms)) * 1e3
    os.environ.pop("MOE_DOWN_BACKWARD")
    base = down_backward.MODES[0]
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                     jnp.max(jnp.abs(b.astype(jnp.float32))))
               for m in grads for a, b in zip(grads[m], grads[base]))
    each = ", ".join(f"{m} {t:.0f} us (x{times[base] / t:.3f})" for m, t in times.items())
    print(f"{name} T={T} layer jit(grad): {each}; max rel diff {diff:.1e}", file=LOG, flush=True)
