"""The grouped weight gradient (ragged_dot's d rhs) on our persistent kernel (with each epilogue)
against CUTLASS's ptr-array kernel and a dense GEMM of the same FLOPs ([M, K]ᵀ · [M, N]), CUPTI device time, one run
(GPU only). The bound of each problem: the larger of its MMA at the dense GEMM's rate and moving its
DRAM bytes (writing the G x K x N output, reading both operands once) at the copy bandwidth.

    python benchmarks/micro/wgrad_ab.py [OUT.txt] [PROBLEMS, e.g. qwen3_w13,qwen3_w2] [KINDS, e.g. uniform,routed4096]
        [KERNELS, e.g. cutlass,persistent-tma; the first is the reference] [no-layer]
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

import jax_moe_permute as jmp
from jax_moe_permute.bench_gemm import PROBLEMS, problem_inputs
from jax_moe_permute.bench_timing import copy_ceiling_tbps
from jax_moe_permute.gemm_primitives import DW_EPILOGUES

LOG = open(sys.argv[1], "a") if len(sys.argv) > 1 and sys.argv[1] != "-" else sys.stdout
NAMES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["qwen3_w13", "qwen3_w2", "deepseek_w13", "deepseek_w2",
                                                          "mixtral_w13"]
KINDS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["uniform", "routed4096"]


def med(f, *a, out_bytes=0):
    """Median CUPTI time in us. The profiler keeps every iteration's output alive until it has
    timed them all, so DeepSeek-V3's 15 GB dW gets 2 iterations (10 ran out of memory)."""
    iterations = int(np.clip(20e9 // max(out_bytes, 1), 2, 10))
    _, ms = profiler.measure(f, iterations=iterations)(*a)
    return float(np.median(ms)) * 1e3


# persistent-<epilogue>: our kernel with each of its epilogues (MOE_SM90_WGRAD_EPILOGUE, cpp/gemm/grouped_wgrad.cu).
KERNELS = ("cutlass",) + tuple(f"persistent-{e}" for e in DW_EPILOGUES)
KERNELS = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "no-layer" else KERNELS


def select(kernel):
    """The kernel is chosen when the call is lowered, its epilogue at every launch: the variables
    stay set while it is timed."""
    kind, _, epilogue = kernel.partition("-")
    os.environ["MOE_GROUPED_GEMM_DW_KERNEL"] = kind
    os.environ["MOE_SM90_WGRAD_EPILOGUE"] = epilogue or DW_EPILOGUES[0]


def wgrad_fn(kernel, sizes):
    """A fresh jitted d rhs."""
    select(kernel)
    return jax.jit(lambda lhs, rhs, ct: jax.vjp(lambda b: jmp.ragged_dot(lhs, b, sizes), rhs)[1](ct)[0])


# One fused reduction: no float32 copy of a 15 GB output.
max_abs_diff = jax.jit(lambda a, b: jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())

copy_tbps = copy_ceiling_tbps()
print(f"copy ceiling {copy_tbps:.2f} TB/s", file=LOG, flush=True)
for name in NAMES:
    for kind in KINDS:
        sizes, lhs, rhs, ct = problem_inputs(name, kind)
        G, (M, K), N = len(sizes), lhs.shape, ct.shape[1]
        flop = 2.0 * M * K * N
        sizes = jnp.asarray(sizes)
        t_dense = med(jax.jit(lambda a, b: jnp.dot(a.T, b)), lhs, ct)
        out_bytes = G * K * N * lhs.dtype.itemsize
        times, reference, diff = {}, None, 0.0
        for kernel in KERNELS:  # outputs compared on the device, one kept (the first, CUTLASS's)
            f = wgrad_fn(kernel, sizes)
            out = f(lhs, rhs, ct)
            if reference is None:
                reference, scale = out, max(float(jnp.abs(out).max()), 1e-30)
            else:
                diff = max(diff, float(max_abs_diff(out, reference)) / scale)
            del out
            times[kernel] = med(f, lhs, rhs, ct, out_bytes=out_bytes)
        del reference
        write_us = out_bytes / (copy_tbps * 1e6)
        dram_us = (out_bytes + lhs.nbytes + ct.nbytes) / (copy_tbps * 1e6)
        bound = max(t_dense, dram_us)
        tc = times[KERNELS[0]]
        each = ", ".join(f"{k} {t:.1f} us ({flop / t / 1e6:.0f} TFLOP/s, x{tc / t:.2f}, /bound {t / bound:.2f})"
                         for k, t in times.items())
        print(f"{name} {kind} (G {G}, M {M}, K {K}, N {N}): dW {each}; dense {t_dense:.1f} us "
              f"({flop / t_dense / 1e6:.0f} TFLOP/s); write {write_us:.1f} us, + reads {dram_us:.1f}; "
              f"max rel diff {diff:.1e}",
              file=LOG, flush=True)

# The layer: jit(grad) of moe_mlp (x, gates, both weights) with each dW kernel, Qwen3 at T = 4096.
if "no-layer" not in sys.argv[4:]:
    from jax_moe_permute import layer, routing
    from jax_moe_permute.bench_layer import MODELS

    for model in ("qwen3",):
        E, K, H, F = MODELS[model]
        T = 4096
        ks = jax.random.split(jax.random.key(1), 5)
        x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
        w_in = (jax.random.normal(ks[1], (E, H, 2 * F), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
        w_out = (jax.random.normal(ks[2], (E, F, H), jnp.float32) * F ** -0.5).astype(jnp.bfloat16)
        r = routing.route(jax.random.normal(ks[3], (T, E), jnp.float32), K)
        ct = jax.random.normal(ks[4], (T, H), jnp.float32)
        times, grads = {}, {}
        # + gather: the fused first GEMM too (MOE_GATHER_GEMM=1, read when the layer is traced):
        # every GEMM of the layer but d lhs on our hand-written kernels.
        for config, kernel, gathers in (("cutlass", "cutlass", "0"), ("persistent", "persistent", "0"),
                                        ("persistent, register stores", "persistent-registers", "0"),
                                        ("persistent + gather", "persistent", "1")):
            select(kernel)
            os.environ["MOE_GATHER_GEMM"] = gathers
            loss = lambda x, w, wi, wo: jnp.vdot(layer.moe_mlp(x, w, r.ids, wi, wo).astype(jnp.float32), ct)
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            grads[config] = g(x, r.weights, w_in, w_out)
            times[config] = med(g, x, r.weights, w_in, w_out)
        os.environ.pop("MOE_GATHER_GEMM")
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                         jnp.max(jnp.abs(b.astype(jnp.float32))))
                   for k in grads for a, b in zip(grads[k], grads["cutlass"]))
        each = ", ".join(f"{k} dW {t:.0f} us (x{times['cutlass'] / t:.3f})" for k, t in times.items())
        print(f"{model} T={T} layer jit(grad): {each}; max rel diff {diff:.1e}", file=LOG, flush=True)
