"""Per-kernel CUPTI times of ours and the reference for a few shapes (GPU only).

    python benchmarks/micro/kernel_breakdown.py [model:T ...]
"""
import statistics
import sys

import jax
from jax.experimental.mosaic.gpu import profiler

import jax_moe_permute as jmp
from jax_moe_permute import bench


def kernels(f, args, iterations=10):
    jax.block_until_ready(f(*args))
    _, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    names = [n for n, _ in per_iter[0]]
    return [(n, 1e3 * statistics.median(it[i][1] for it in per_iter)) for i, n in enumerate(names)]


def main(specs):
    for spec in specs:
        model, T = spec.split(":")
        T = int(T)
        E = bench.MODELS[model][0]
        inputs = bench.shape_inputs(model, T)
        for lib_name, lib in (("ours", jmp), ("ref", jmp.reference)):
            for op in bench.OPS:
                ks = kernels(*bench.op_call(lib, E, inputs, op))
                total = sum(t for _, t in ks)
                print(f"{model} T={T} {lib_name} {op}: {total:.1f} us")
                for n, t in ks:
                    print(f"    {t:8.1f} us  {n[:110]}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["mixtral:1", "deepseek:1", "qwen3:64", "deepseek:64", "mixtral:4096", "deepseek:16384"])
