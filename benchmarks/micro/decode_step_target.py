"""Runs a 2-layer Qwen3-30B-A3B decode step (bench_decode's scan, random router and x) three
times at T tokens, untimed: a target for `ncu`. Each layer launches its two CUTLASS grouped GEMMs
(`device_kernel`) above decode sizes; skip the first step's:

    ncu --clock-control none -k regex:device_kernel --launch-skip 4 --launch-count 4 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis python benchmarks/micro/decode_step_target.py 8
"""
import sys

import jax
import jax.numpy as jnp

from jax_moe_permute import bench_decode as bd

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8
model = bd.MODELS["qwen3"]._replace(layers=2)
params = bd.stacked_weights(model, 2)
step = jax.jit(bd.decode_step("ours", model))
x = jax.random.normal(jax.random.PRNGKey(0), (T, model.hidden)).astype(jnp.bfloat16)
for _ in range(3):
    jax.block_until_ready(step(x, params))
