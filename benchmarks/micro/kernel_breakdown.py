"""Per-kernel CUPTI times of ours and the reference for a few shapes (GPU only).

    python benchmarks/micro/kernel_breakdown.py [--ops permute,unpermute] [--ours] [model:T ...]
"""
import argparse
import statistics

import jax
from jax.experimental.mosaic.gpu import profiler

import jax_moe_permute as jmp
from jax_moe_permute import bench


def kernels(f, args, iterations=10):
    jax.block_until_ready(f(*args))
    _, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    names = [n for n, _ in per_iter[0]]
    return [(n, 1e3 * statistics.median(it[i][1] for it in per_iter)) for i, n in enumerate(names)]


def main(specs, ops, ours_only):
    libs = (("ours", jmp),) if ours_only else (("ours", jmp), ("ref", jmp.reference))
    for spec in specs:
        model, T = spec.split(":")
        T = int(T)
        E = bench.MODELS[model][0]
        inputs = bench.shape_inputs(model, T)
        for lib_name, lib in libs:
            for op in ops:
                ks = kernels(*bench.op_call(lib, E, inputs, op))
                total = sum(t for _, t in ks)
                print(f"{model} T={T} {lib_name} {op}: {total:.1f} us")
                for n, t in ks:
                    print(f"    {t:8.1f} us  {n[:110]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", metavar="model:T",
                        default=["mixtral:1", "deepseek:1", "qwen3:64", "deepseek:64", "mixtral:4096", "deepseek:16384"])
    parser.add_argument("--ops", default=",".join(bench.OPS), help="comma-separated ops (default: all)")
    parser.add_argument("--ours", action="store_true", help="skip the reference")
    args = parser.parse_args()
    main(args.specs, args.ops.split(","), args.ours)
