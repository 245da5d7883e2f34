"""ragged_dot's forward on CUTLASS's grouped GEMM (the default tile) against gather_gemm's kernel as a
plain grouped GEMM (row r reads lhs row r, no activation: its persistent schedule, staggered
epilogues and a group's last tile of <= 64 rows on one consumer) and a dense GEMM of the same
FLOPs; CUPTI device time, one run (GPU only).

    python benchmarks/micro/rows_gemm_ab.py [OUT.txt] [PROBLEMS] [KINDS, e.g. uniform,routed4096]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_moe_permute import gather_gemm
from jax_moe_permute.bench_gemm import PROBLEMS, problem_inputs
from jax_moe_permute.grouped_gemm import ragged_dot

LOG = open(sys.argv[1], "a") if len(sys.argv) > 1 and sys.argv[1] != "-" else sys.stdout
NAMES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["qwen3_w13", "qwen3_w2", "deepseek_w13", "deepseek_w2",
                                                          "mixtral_w2"]
KINDS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["uniform", "routed4096"]


def med(f, *a):
    _, ms = profiler.measure(jax.jit(f), iterations=10)(*a)
    return float(np.median(ms)) * 1e3


def rows_kernel(a, b, s):
    rows = jnp.arange(a.shape[0], dtype=jnp.int32)
    return gather_gemm.gather_gemm(a, rows, s, b, activation="none")[0]


for name in NAMES:
    for kind in KINDS:
        sizes, lhs, rhs, _ = problem_inputs(name, kind)
        sizes = jnp.asarray(sizes)
        M, K = lhs.shape
        N = rhs.shape[2]
        flop = 2.0 * M * K * N
        dense_b = rhs[0]
        t_dense = med(jnp.dot, lhs, dense_b)
        t_cutlass = med(ragged_dot, lhs, rhs, sizes)
        t_rows = med(rows_kernel, lhs, rhs, sizes)
        a = np.asarray(jax.jit(ragged_dot)(lhs, rhs, sizes), np.float32)
        b = np.asarray(jax.jit(rows_kernel)(lhs, rhs, sizes), np.float32)
        err = float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30))
        tf = lambda t: flop / t / 1e6
        print(f"{name:13s} {kind:11s} M={M:6d} dense {t_dense:8.1f} us ({tf(t_dense):4.0f} TF/s)  cutlass {t_cutlass:8.1f}"
              f" ({tf(t_cutlass):4.0f})  rows kernel {t_rows:8.1f} ({tf(t_rows):4.0f})  cutlass/rows {t_cutlass / t_rows:5.3f}"
              f"  bitwise {bool(np.array_equal(a, b))} rel diff {err:.1e}", file=LOG, flush=True)
