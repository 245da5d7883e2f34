"""The backward of the layer's second half (MOE_DOWN_BACKWARD): the plain tangent transposed op by
op against down_backward.py's primitive, whose transpose runs it in one pass. Per model, CUPTI
device time, one run (GPU only): the op alone (down_vjp_p on the kernel, its composition, and the
composition's d lhs GEMM alone), then one moe_mlp layer's jit(grad) (x, gates, both weights):

    python benchmarks/micro/down_backward_ab.py [T] [OUT.txt] [MODELS, e.g. qwen3,mixtral]
"""
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_moe_permute import down_backward, gemm_primitives, layer
from jax_moe_permute.bench_layer import MODELS, layer_inputs, layer_route

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
LOG = open(sys.argv[2], "a") if len(sys.argv) > 2 and sys.argv[2] != "-" else sys.stdout
NAMES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["qwen3"]


def device_us(f, *args):
    _, ms = profiler.measure(f, iterations=10)(*args)
    return float(np.median(ms)) * 1e3


def op_alone(name, r, w_out):
    """down_vjp_p at the layer's sizes, on fresh rows: kernel, composition, the GEMM alone."""
    E, K, H, F = MODELS[name]
    R = r.ids.size
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    ct = jax.random.normal(k[0], (R, H), jnp.bfloat16)
    gate_up = jax.random.normal(k[1], (R, 2 * F), jnp.bfloat16)
    w = jax.random.uniform(k[2], (R, 1), jnp.float32)
    sizes = jnp.bincount(r.ids.reshape(-1), length=E).astype(jnp.int32)
    params = dict(activation="swiglu", weighted=True)
    kernel = jax.jit(functools.partial(down_backward.down_vjp, **params))
    composition = jax.jit(lambda *a: down_backward._vjp_composition(*a, jnp.zeros((0,), jnp.int32), gathered=False,
                                                                    **params))
    gemm = jax.jit(lambda ct, w_out, sizes: gemm_primitives.ragged_dot_bind(
        ct[None], w_out[None], sizes[None], rhs_transposed=True, out_dtype=ct.dtype, precision=None)[0])
    args = (ct, gate_up, w, w_out, sizes)
    got, want = kernel(*args), composition(*args)
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                     jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(got, want))
    t_comp, t_gemm = device_us(composition, *args), device_us(gemm, ct, w_out, sizes)
    flops = 2 * R * F * H
    mb = (R * H + 2 * R * 2 * F + R * F + E * F * H) * 2 / 1e6  # ct, gate_up in and out, w * h, w_out
    t = device_us(kernel, *args)
    print(f"{name} T={T} down_vjp alone (R {R}, {flops / 1e9:.0f} GFLOP, {mb:.0f} MB): kernel {t:.1f} us (x{t_comp / t:.3f} of the "
          f"composition, {flops / t / 1e6:.0f} TFLOP/s); "
          f"composition {t_comp:.1f} us, its d lhs GEMM alone {t_gemm:.1f} us ({flops / t_gemm / 1e6:.0f} TFLOP/s); "
          f"max rel diff {diff:.1e}", file=LOG, flush=True)


for name in NAMES:
    K = MODELS[name][1]
    inputs = layer_inputs(name, T)  # the layer bench's inputs and routing
    x, w_in, w_out, ct = inputs["x"], inputs["w_in"], inputs["w_out"], inputs["ct"]
    r = layer_route(x, inputs["router"], K)
    op_alone(name, r, w_out)
    loss = lambda x, w, wi, wo: jnp.vdot(layer.moe_mlp(x, w, r.ids, wi, wo).astype(jnp.float32), ct)
    times, grads = {}, {}
    for mode in down_backward.MODES:  # read when the layer is traced: a fresh jit per mode
        os.environ["MOE_DOWN_BACKWARD"] = mode
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        grads[mode] = g(x, r.weights, w_in, w_out)
        times[mode] = device_us(g, x, r.weights, w_in, w_out)
    os.environ.pop("MOE_DOWN_BACKWARD")
    base = down_backward.MODES[0]
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                     jnp.max(jnp.abs(b.astype(jnp.float32))))
               for m in grads for a, b in zip(grads[m], grads[base]))
    each = ", ".join(f"{m} {t:.0f} us (x{times[base] / t:.3f})" for m, t in times.items())
    print(f"{name} T={T} layer jit(grad): {each}; max rel diff {diff:.1e}", file=LOG, flush=True)
