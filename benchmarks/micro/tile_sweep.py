"""Time each grouped-GEMM tile on the benchmark's problems, forcing it with MOE_GROUPED_GEMM_TILE
(forward and d lhs) or MOE_GROUPED_GEMM_DW_TILE (dW), both read by the kernels at every call, to
choose the tile rules in cpp/gemm/ffi_grouped_gemm_cuda.cc:

    python benchmarks/micro/tile_sweep.py OUT.json [KINDS] [rows|dw] [PROBLEMS] [TILES]   (comma-separated; defaults below)

A tile named with a run length, e.g. 128x256r8, also sets MOE_GROUPED_GEMM_RUN (rows) or
MOE_GROUPED_GEMM_DW_RUN (dw): the tiles each cluster takes in a row (cpp/gemm/run_tile_scheduler.cuh).

rows (the default): forward and forward+backward per tile (d lhs on the same tile, dW on its own
rule), the same-run dense GEMM, and for decode the forward's decode kernel too and the time over
the weight-read bound at the copy bandwidth. dw: the weight gradient alone per tile. Each tile's output is compared with the first
tile's (max_diff). Needs an sm_90 GPU. benchmarks/results/ragged_dot-tiles-h200.json holds a run
with three more tiles, since removed (128x128 cooperative, 64x128 and 64x64 ping-pong);
docs/design-notes.md has the numbers."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp
from jax_moe_permute.bench_timing import copy_ceiling_tbps, device_us
from jax_moe_permute.bench_gemm import PROBLEMS, op_call, problem_inputs
from jax_moe_permute.grouped_gemm import DECODE_TILE, TILES

KINDS = ("uniform", "skewed", "decode1", "decode8", "decode64")


def main(out_path: str, kinds=KINDS, target: str = "rows", problems=tuple(PROBLEMS), tiles=TILES) -> None:
    assert jmp.grouped_gemm.kernels_available(), "needs an sm_90 GPU and the CUTLASS kernels"
    variable = {"rows": "MOE_GROUPED_GEMM_TILE", "dw": "MOE_GROUPED_GEMM_DW_TILE"}[target]
    run_variable = {"rows": "MOE_GROUPED_GEMM_RUN", "dw": "MOE_GROUPED_GEMM_DW_RUN"}[target]
    copy = copy_ceiling_tbps()
    rows = []
    for name in problems:
        G, topk, rows_per_group, K, N = PROBLEMS[name]
        for kind in kinds:
            sizes, lhs, rhs, ct = problem_inputs(name, kind)
            M = int(sizes.sum())
            gs = jnp.asarray(sizes)
            flops = 2 * M * K * N
            args = (lhs, rhs, gs) if target == "rows" else (lhs, rhs, ct)
            dense_us = device_us(jax.jit(jnp.dot), lhs, rhs[0], iterations=10) if target == "rows" else None
            bound_us = (np.count_nonzero(sizes) * K * N + M * K + M * N) * 2 / copy / 1e6
            first = None
            for tile in tuple(tiles) + ((DECODE_TILE,) if target == "rows" and kind.startswith("decode") else ()):
                shape, _, run = tile.partition("r")
                os.environ[variable] = shape
                os.environ[run_variable] = run or "1"
                # Traced anew per tile: the decode kernel is chosen when a call is lowered.
                fwd, train = op_call(jmp.ragged_dot, "ragged_dot", gs), op_call(jmp.ragged_dot, "ragged_dot_bwd", gs)
                d_rhs = jax.jit(lambda a, b, c: jax.vjp(lambda b: jmp.ragged_dot(a, b, gs), b)[1](c)[0])
                call = fwd if target == "rows" else d_rhs
                y = np.asarray(call(*args), np.float32)
                first = y if first is None else first
                us = device_us(call, *args, iterations=10)
                row = dict(problem=name, kind=kind, target=target, tile=tile, M=M, us=us, tflops=flops / us / 1e6,
                           max_diff=float(np.abs(y - first).max(initial=0.0)))
                if target == "rows":
                    train_us = None if kind.startswith("decode") else device_us(train, lhs, rhs, ct, iterations=5)
                    row.update(fb_us=train_us, fb_tflops=3 * flops / train_us / 1e6 if train_us else None,
                               dense_us=dense_us, dense_tflops=flops / dense_us / 1e6, bound_ratio=us / bound_us)
                rows.append(row)
                print(row, flush=True)
                del y, fwd, train, d_rhs, call
            del os.environ[variable], os.environ[run_variable]
            del lhs, rhs, ct, args
            with open(out_path, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else KINDS,
         sys.argv[3] if len(sys.argv) > 3 else "rows",
         tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else tuple(PROBLEMS),
         tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else TILES)
