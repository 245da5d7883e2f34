"""Runs one op on one shape a few times, untimed: a target for `ncu` or `compute-sanitizer`.

    ncu --clock-control none -k regex:tile_offsets python benchmarks/micro/run_op.py mixtral:4096 permute
"""
import argparse

import jax

import jax_moe_permute as jmp
from jax_moe_permute import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", metavar="model:T")
    parser.add_argument("op", choices=bench.OPS)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--ref", action="store_true", help="run the reference instead of ours")
    args = parser.parse_args()
    model, T = args.spec.split(":")
    lib = jmp.reference if args.ref else jmp
    f, call_args = bench.op_call(lib, bench.MODELS[model][0], bench.shape_inputs(model, int(T)), args.op)
    for _ in range(args.calls):
        jax.block_until_ready(f(*call_args))
