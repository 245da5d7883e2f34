"""Per-kernel CUPTI times of ours and the reference for a few shapes (GPU only).

    python benchmarks/micro/kernel_breakdown.py [model:T ...]
"""
import statistics
import sys

import jax
from jax.experimental.mosaic.gpu import profiler

import jax_moe_permute as jmp
from jax_moe_permute import bench


def kernels(f, *args, iterations=10):
    jax.block_until_ready(f(*args))
    _, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    names = [n for n, _ in per_iter[0]]
    return [(n, 1e3 * statistics.median(it[i][1] for it in per_iter)) for i, n in enumerate(names)]


def main(specs):
    for spec in specs:
        model, T = spec.split(":")
        T = int(T)
        E, K, H, _ = bench.MODELS[model]
        ids, weights = bench.routing(T, E, K)
        hidden = jax.random.normal(jax.random.PRNGKey(1), (T, H)).astype("bfloat16")
        res = jmp.moe_permute(hidden, ids, E)
        inputs = dict(hidden=hidden, ids=ids, weights=weights, row_map=res.row_map, rows=res.hidden,
                      ct_rows=res.hidden, ct_tokens=hidden)
        for lib_name, lib in (("ours", jmp), ("ref", jmp.reference)):
            for op, (f, args) in bench.op_calls(lib, E, inputs).items():
                ks = kernels(f, *args)
                total = sum(t for _, t in ks)
                print(f"{model} T={T} {lib_name} {op}: {total:.1f} us")
                for n, t in ks:
                    print(f"    {t:8.1f} us  {n[:110]}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["mixtral:1", "deepseek:1", "qwen3:64", "deepseek:64", "mixtral:4096", "deepseek:16384"])
