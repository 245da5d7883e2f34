"""Benchmark: ours vs the jnp reference vs a device-copy ceiling, side by side in one run.

    python -m jax_moe_permute.bench [--quick] [--model mixtral,qwen3] [--tokens 1,4096]
                                    [--ops permute,unpermute] [--json out.json] [--plot out.png]

`--ops layer,layer_bwd` runs the whole-layer benchmark instead (bench_layer.py),
`--ops ragged_dot,ragged_dot_bwd` the grouped GEMM's (bench_gemm.py), `--ops decode` a
serving decode step over a stack of layers (bench_decode.py) and `--ops ep` one expert-parallel
layer over every device (bench_ep.py).

On GPU, device time is the sum of each op's kernel times from CUPTI
(jax.experimental.mosaic.gpu.profiler); on CPU a wall-clock median. Bytes moved per op are the
fewest it must move (op_bytes): T*H*itemsize*(1+K) for permute (each token row read once, its
K copies written), unpermute (K rows read, one written) and permute's backward (an unpermute);
T*H*itemsize*(1+2K) for unpermute's backward (the cotangent read once, K rows of its gradient
written, and K expert rows read again for the weights' gradient); for permute with an
expert_map or align_size=128, the rows of routed tokens read plus every output row written.

"% ceil" is our TB/s over op_ceiling_tbps (bench_timing): the faster of a warm copy of the same
bytes (on GPU a jitted copy timed like the op, CUPTI kernel time; on CPU numpy's copy) and the
run's large copy (torch's 4 GiB copy on GPU, HBM; a 128 MiB numpy copy on CPU). A small op's
buffers sit in L2 or cache, where a copy beats device memory's bandwidth: held to the large copy
alone, they read over 100%. On CPU the op's wall clock holds jax's dispatch and the copy's does
not: small ops read low there. "% mem" is our TB/s over the large copy alone.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp

from . import bench_decode, bench_ep, bench_gemm, bench_layer, bench_memory
from .bench_timing import (copy_ceiling_tbps, device_us, figure, on_gpu, op_ceiling_tbps, progress,
                           same_bytes_copy_tbps, save_figure, save_rows, text_table)

MODELS = {  # name: (E, K, H, token counts)
    "mixtral": (8, 2, 4096, (1, 64, 2048, 4096, 32768)),
    "qwen3": (128, 8, 2048, (1, 64, 2048, 4096, 16384)),
    "deepseek": (256, 8, 7168, (1, 64, 1024, 4096, 16384)),
    "cpu": (64, 4, 1024, (4096,)),  # the CPU target shape (not in the default sweep)
}
DEFAULT_MODELS = ("mixtral", "qwen3", "deepseek")
QUICK_TOKENS = (1, 64, 4096)
OPS = ("permute", "unpermute", "permute_bwd", "unpermute_bwd", "permute_ep", "permute_align128")
# permute_ep: expert parallelism, an expert_map keeping E/8 experts local; permute_align128:
# expert blocks padded to 128 rows. Both are charged the rows they must read and write.
ROUTED_OPS = ("permute_ep", "permute_align128")


def routing(T: int, E: int, K: int, seed: int = 0):
    """Top-k of random router logits: K distinct experts per token and softmax weights."""
    logits = jax.random.normal(jax.random.PRNGKey(seed), (T, E), jnp.float32)
    weights, ids = jax.lax.top_k(logits, K)
    return ids.astype(jnp.int32), jax.nn.softmax(weights, axis=-1)


def op_call(lib, E: int, inputs: dict, op: str):
    """(jitted function, its arguments) of `op` for `lib` (jmp or jmp.reference). The backward ops
    time only the backward pass: the forward runs once here, and its vjp function (holding the
    residuals, e.g. row_map) is an argument of the jitted call."""
    x = inputs
    permute = lambda h, i: lib.moe_permute(h, i, E)
    unpermute = lambda r, rm, w: lib.moe_unpermute(r, rm, w)
    apply_vjp = lambda vjp, ct: vjp(ct)
    if op == "permute":
        return jax.jit(permute), (x["hidden"], x["ids"])
    if op == "unpermute":
        return jax.jit(unpermute), (x["rows"], x["row_map"], x["weights"])
    if op == "permute_bwd":  # gradient w.r.t. hidden: an unweighted unpermute of the cotangent
        return jax.jit(apply_vjp), (jax.vjp(lambda h: permute(h, x["ids"])[0], x["hidden"])[1], x["ct_rows"])
    if op == "unpermute_bwd":  # gradient w.r.t. expert rows and weights
        vjp = jax.vjp(lambda r, w: unpermute(r, x["row_map"], w), x["rows"], x["weights"])[1]
        return jax.jit(apply_vjp), (vjp, x["ct_tokens"])
    if op == "permute_ep":
        local = max(1, E // 8)
        expert_map = jnp.where(jnp.arange(E) < local, jnp.arange(E), -1).astype(jnp.int32)
        f = lambda h, i, m: lib.moe_permute(h, i, E, expert_map=m, num_local_experts=local)
        return jax.jit(f), (x["hidden"], x["ids"], expert_map)
    if op == "permute_align128":
        return jax.jit(lambda h, i: lib.moe_permute(h, i, E, align_size=128)), (x["hidden"], x["ids"])
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def shape_inputs(model: str, T: int, dtype=jnp.bfloat16) -> dict:
    """Random inputs of every op at one grid shape (routing of random router logits)."""
    E, K, H, _ = MODELS[model]
    ids, weights = routing(T, E, K)
    hidden = jax.random.normal(jax.random.PRNGKey(1), (T, H), jnp.float32).astype(dtype)
    res = jmp.moe_permute(hidden, ids, E)
    rows_shape = res.hidden.shape
    return {
        "hidden": hidden, "ids": ids, "weights": weights, "row_map": res.row_map,
        "rows": jax.random.normal(jax.random.PRNGKey(2), rows_shape, jnp.float32).astype(dtype),
        "ct_rows": jax.random.normal(jax.random.PRNGKey(3), rows_shape, jnp.float32).astype(dtype),
        "ct_tokens": jax.random.normal(jax.random.PRNGKey(4), (T, H), jnp.float32).astype(dtype),
    }


def op_bytes(op: str, T: int, H: int, K: int, itemsize: int, result=None) -> int:
    """The fewest bytes `op` must move through device memory (module docstring). For the
    ROUTED_OPS, from their `result`: the rows of tokens with a local entry read, every output
    row written (copies, padding and unused rows alike)."""
    if op in ROUTED_OPS:
        routed = int(np.sum(np.any(np.asarray(result.row_map) >= 0, axis=1)))
        return (routed + result.hidden.shape[0]) * H * itemsize
    return T * H * itemsize * (1 + (2 * K if op == "unpermute_bwd" else K))


def bench_shape(model: str, T: int, ops, copy_tbps: float, dtype=jnp.bfloat16, iterations: int = 20):
    E, K, H, _ = MODELS[model]
    inputs = shape_inputs(model, T, dtype)
    rows = []
    for op in ops:
        (f, args), (ref_f, ref_args) = op_call(jmp, E, inputs, op), op_call(jmp.reference, E, inputs, op)
        us = device_us(f, *args, iterations=iterations)
        ref_us = device_us(ref_f, *ref_args, iterations=iterations)
        nbytes = op_bytes(op, T, H, K, jnp.dtype(dtype).itemsize, f(*args) if op in ROUTED_OPS else None)
        rows.append(dict(model=model, T=T, H=H, E=E, K=K, op=op, us=us, ref_us=ref_us,
                         TBps=nbytes / us / 1e6, ceil_TBps=op_ceiling_tbps(nbytes, copy_tbps, iterations),
                         same_bytes_copy_TBps=same_bytes_copy_tbps(nbytes, iterations), copy_TBps=copy_tbps,
                         bytes=nbytes))
    return rows


def format_table(rows) -> str:
    """% ceil: against op_ceiling_tbps (module docstring); % mem: against the large copy alone."""
    head = (f"{'model':9} {'T':>6} {'op':14} {'us':>9} {'ref us':>9} {'speed-up':>8} {'TB/s':>6} "
            f"{'ceil TB/s':>9} {'% ceil':>6} {'% mem':>6}")
    return text_table(head, (f"{r['model']:9} {r['T']:>6} {r['op']:14} {r['us']:9.1f} {r['ref_us']:9.1f} "
                             f"{r['ref_us'] / r['us']:7.2f}x {r['TBps']:6.2f} {r['ceil_TBps']:9.2f} "
                             f"{100 * r['TBps'] / r['ceil_TBps']:5.0f}% {100 * r['TBps'] / r['copy_TBps']:5.0f}%"
                             for r in rows))


def plot(rows, path: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = figure(1, len(models), 5, 4)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for op in dict.fromkeys(r["op"] for r in mine):
            pts = sorted((r["T"], r["TBps"], r["bytes"] / r["ref_us"] / 1e6) for r in mine if r["op"] == op)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op} (ours)")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", ls="--", color=line.get_color(),
                    label=f"{op} (reference)")
        ceil = sorted({(r["T"], r["ceil_TBps"]) for r in mine if r["op"] == mine[0]["op"]})
        ax.plot([p[0] for p in ceil], [p[1] for p in ceil], color="0.5", ls=":",
                label=f"ceiling at {mine[0]['op']}'s bytes")
        ax.axhline(mine[0]["copy_TBps"], color="k", lw=1, label="large copy (device memory)")
        ax.set(xscale="log", xlabel="tokens T", ylabel="TB/s", title=model)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    # --help after the dispatch below, so `--ops decode --help` shows bench_decode's flags
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                add_help=False)
    p.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS} only")
    p.add_argument("--model", default=",".join(DEFAULT_MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--tokens", default="", help="comma-separated token counts (overrides the grid)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--plot", default="", help="write a PNG plot here")
    args, unknown = p.parse_known_args(argv)

    ops = args.ops.split(",")
    for family in (bench_gemm, bench_layer, bench_memory, bench_decode, bench_ep):  # own grids, rows, tables and plots
        if set(ops) & set(family.OPS):
            if not set(ops) <= set(family.OPS):
                p.error(f"{', '.join(family.OPS)} run on their own; ask for the other ops apart")
            return family.main(argv)
    if args.help:
        p.print_help()
        return 0
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    jobs = []
    for model in args.model.split(","):
        tokens = MODELS[model][3]
        if args.tokens:
            tokens = tuple(int(t) for t in args.tokens.split(","))
        elif args.quick:
            tokens = QUICK_TOKENS
        if not on_gpu():  # keep CPU runs short
            tokens = tuple(t for t in tokens if t <= 4096)
        jobs += [(model, t) for t in tokens]

    copy_tbps = copy_ceiling_tbps()
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); large copy {copy_tbps:.2f} TB/s "
          "(% mem); % ceil: against the faster of it and a warm copy of the op's own bytes", flush=True)
    rows = []
    for model, T in progress(jobs):
        rows += bench_shape(model, T, ops, copy_tbps, iterations=args.iterations)
        save_rows(rows, args.json)
    print(format_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
