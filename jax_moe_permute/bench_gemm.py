"""Benchmark of the grouped GEMM: jax_moe_permute.ragged_dot against jax.lax.ragged_dot and a
dense GEMM of the same FLOPs, all measured in one run.

    python -m jax_moe_permute.bench --ops ragged_dot,ragged_dot_bwd [--quick] [--json out.json] [--plot out.png]

Problems: the expert GEMMs of Mixtral, Qwen3 and DeepSeek-V3 (w13: hidden -> 2 x ffn, w2: ffn ->
hidden) at 4096 tokens, with group sizes uniform (every expert the same rows) and skewed
(Zipf-like: expert i gets rows proportional to 1 / (i + 1), the last eighth of the experts none);
and decode: T = 1, 8, 64 tokens routed top-k among the experts at random ('routed<T>' routes T
tokens the same way at any T: the uneven group sizes of real routing at training sizes).

ragged_dot times the forward (FLOPs 2 M K N over the M routed rows); ragged_dot_bwd times the
forward and both gradients (three GEMMs, 6 M K N). The dense GEMM is an [M, K] x [K, N] jnp.dot
(and its two gradients) of the same FLOPs. Decode rows also give the time to read the routed
experts' weights once at the measured copy bandwidth (the memory bound at small T); the
backward rows the time to read the weights twice and write dW once (the weight-gradient bound).
lax.ragged_dot is timed with fewer iterations when one call takes longer than a second, and not
at all where XLA's dense expansion (seen on jax 0.11.2: a zero-padded [M, G, K] operand) would
cost more than LAX_MAX_EXPANDED_FLOPS or LAX_MAX_EXPANDED_BYTES (`--no-lax`: not at all).
Where tokamax is installed, its `ragged_dot` with the default implementation is timed alongside.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp
from .bench_timing import copy_ceiling_tbps, device_us_or_none, figure, on_gpu, save_figure, save_rows

OPS = ("ragged_dot", "ragged_dot_bwd")
# name: (experts G, top-k, rows per expert at uniform routing, K, N)
PROBLEMS = {
    "mixtral_w13": (8, 2, 1024, 4096, 28672),
    "mixtral_w2": (8, 2, 1024, 14336, 4096),
    "qwen3_w13": (128, 8, 256, 2048, 1536),
    "qwen3_w2": (128, 8, 256, 768, 2048),
    "deepseek_w13": (256, 8, 128, 7168, 4096),
    "deepseek_w2": (256, 8, 128, 2048, 7168),
}
SMOKE_PROBLEMS = {"tiny": (4, 2, 64, 128, 256)}  # a CPU smoke test (tests/test_bench.py), not in the default set
DECODE_TOKENS = (1, 8, 64)
# XLA:GPU may lower lax.ragged_dot to a dense dot over the zero-padded expansion (G times the
# FLOPs); past this many expanded FLOPs the reference is not timed (about 1.5 s at 700 TFLOP/s).
LAX_MAX_EXPANDED_FLOPS = 1e15
LAX_MAX_EXPANDED_BYTES = 40e9  # the zero-padded [M, G * K] operand (DeepSeek-V3: 120 GB, out of memory)


def group_sizes(kind: str, G: int, topk: int, rows_per_group: int, seed: int = 0) -> np.ndarray:
    """Rows per expert: 'uniform', 'skewed' (Zipf-like, some experts empty, same total) or
    'decode<T>' or 'routed<T>' (T tokens routed top-k at random)."""
    if kind == "uniform":
        return np.full(G, rows_per_group, np.int32)
    if kind == "skewed":
        live = G - G // 8
        weights = np.zeros(G)
        weights[:live] = 1.0 / np.arange(1, live + 1)
        total = G * rows_per_group
        sizes = np.floor(weights / weights.sum() * total).astype(np.int32)
        sizes[0] += total - sizes.sum()
        return np.random.default_rng(seed).permutation(sizes).astype(np.int32)
    T = int(kind.removeprefix("decode").removeprefix("routed"))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(G, size=topk, replace=False) for _ in range(T)])
    return np.bincount(ids.ravel(), minlength=G).astype(np.int32)


def problem_inputs(name: str, kind: str, dtype=jnp.bfloat16):
    """(group sizes, lhs [M, K], rhs [G, K, N], cotangent [M, N]) of one problem, random normal."""
    G, topk, rows_per_group, K, N = {**PROBLEMS, **SMOKE_PROBLEMS}[name]
    sizes = group_sizes(kind, G, topk, rows_per_group)
    M = int(sizes.sum())
    keys = jax.random.split(jax.random.PRNGKey(hash((name, kind)) % 2**31), 4)
    # Drawn in dtype: a float32 draw of DeepSeek-V3's rhs would take 30 GB.
    lhs = jax.random.normal(keys[0], (M, K), dtype)
    rhs = jax.random.normal(keys[1], (G, K, N), dtype) * jnp.asarray(K**-0.5, dtype)
    ct = jax.random.normal(keys[2], (M, N), dtype)
    return sizes, lhs, rhs, ct


def tokamax_ragged_dot():
    """tokamax.ragged_dot (its default implementation) where tokamax is installed, else None."""
    try:
        import tokamax
        from absl import flags
    except ImportError:
        return None
    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; ours are not absl's to parse
        flags.FLAGS.mark_as_parsed()
    return tokamax.ragged_dot


def fwd_bwd(fn):
    """(out, d lhs, d rhs) of fn at a cotangent: the three GEMMs of a training step."""
    def run(a, b, ct):
        out, vjp = jax.vjp(fn, a, b)
        return (out, *vjp(ct))
    return jax.jit(run)


def op_call(ragged_dot, op: str, gs):
    """One implementation's jitted call for an op: f(lhs, rhs, group sizes) for the forward,
    f(lhs, rhs, cotangent) for the forward and both gradients."""
    if op == "ragged_dot":
        return jax.jit(lambda a, b, s: ragged_dot(a, b, s))
    return fwd_bwd(lambda a, b: ragged_dot(a, b, gs))


def bench_problem(name: str, kind: str, ops, copy_tbps: float, iterations: int, dtype=jnp.bfloat16,
                  with_lax: bool = True):
    sizes, lhs, rhs, ct = problem_inputs(name, kind, dtype)
    (M, K), (G, _, N) = lhs.shape, rhs.shape
    dense_rhs = rhs[0]
    gs = jnp.asarray(sizes)
    itemsize = jnp.dtype(dtype).itemsize
    routed = int(np.count_nonzero(sizes))
    weight_bytes = routed * K * N * itemsize
    rows = []
    tokamax_fn = tokamax_ragged_dot()
    for op in ops:
        ours, ref = op_call(jmp.ragged_dot, op, gs), op_call(jax.lax.ragged_dot, op, gs)
        tokamax_call = tokamax_fn and op_call(tokamax_fn, op, gs)
        if op == "ragged_dot":
            flops = 2 * M * K * N
            dense = jax.jit(lambda a, b: jnp.dot(a, b))
            args, dense_args = (lhs, rhs, gs), (lhs, dense_rhs)
            bound_bytes = weight_bytes + (M * K + M * N) * itemsize
        else:
            flops = 6 * M * K * N
            dense = fwd_bwd(jnp.dot)
            args, dense_args = (lhs, rhs, ct), (lhs, dense_rhs, ct)
            # weights read by the forward and d lhs, dW written (every group's), activations.
            bound_bytes = 2 * weight_bytes + G * K * N * itemsize + 3 * (M * K + M * N) * itemsize
        us = device_us_or_none(ours, *args, iterations=iterations)
        ref_us = None
        expanded_bytes = G * M * K * itemsize
        lax_fits = not on_gpu() or (G * flops <= LAX_MAX_EXPANDED_FLOPS and expanded_bytes <= LAX_MAX_EXPANDED_BYTES)
        if with_lax and lax_fits:
            ref_us = device_us_or_none(ref, *args, iterations=max(3, iterations // 4))
        elif with_lax:
            print(f"  (lax.ragged_dot not timed: dense expansion of {G} x {flops:.2g} FLOPs, "
                  f"{expanded_bytes / 1e9:.0f} GB)", flush=True)
        tokamax_us = None
        if tokamax_call:
            try:  # another project's kernels: a shape it rejects is a missing number, not a failed run
                tokamax_us = device_us_or_none(tokamax_call, *args, iterations=iterations)
            except Exception as e:  # noqa: BLE001
                print(f"  (tokamax failed: {type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
        dense_us = device_us_or_none(dense, *dense_args, iterations=iterations)
        tflops = lambda t: None if not t else flops / t / 1e6
        bound_us = bound_bytes / copy_tbps / 1e6
        rows.append(dict(problem=name, groups=kind, op=op, G=G, M=M, K=K, N=N, routed_groups=routed,
                         us=us, lax_us=ref_us, tokamax_us=tokamax_us, dense_us=dense_us, TFLOPs=tflops(us),
                         lax_TFLOPs=tflops(ref_us), tokamax_TFLOPs=tflops(tokamax_us),
                         dense_TFLOPs=tflops(dense_us), memory_bound_us=bound_us, copy_TBps=copy_tbps))
        print(format_row(rows[-1]), flush=True)
    return rows


def _f(x, spec):
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


def format_row(r) -> str:
    ratio = lambda a, b: None if not a or not b else a / b
    return (f"{r['problem']:13} {r['groups']:8} {r['op']:14} {r['M']:>6} {_f(r['us'], '10.1f')} "
            f"{_f(r['TFLOPs'], '7.1f')} {_f(r['lax_TFLOPs'], '7.1f')} {_f(r['dense_TFLOPs'], '7.1f')} "
            f"{_f(ratio(r['TFLOPs'], r['dense_TFLOPs']), '6.2f')} {_f(ratio(r['lax_us'], r['us']), '7.1f')} "
            f"{_f(ratio(r['us'], r['memory_bound_us']), '6.2f')} {_f(ratio(r.get('tokamax_us'), r['us']), '7.2f')}")


HEADER = (f"{'problem':13} {'groups':8} {'op':14} {'M':>6} {'us':>10} {'TFLOP/s':>7} {'lax':>7} {'dense':>7} "
          f"{'/dense':>6} {'x lax':>7} {'/bound':>6} {'x tkmx':>7}")


def plot(rows, path: str) -> None:
    kinds = [k for k in dict.fromkeys(r["groups"] for r in rows) if not k.startswith("decode")]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = figure(1, len(ops) + 1, 6, 4.5)
    for ax, op in zip(axes[0], ops):
        names = list(PROBLEMS)
        x = np.arange(len(names))
        series = [(f"ours {k}", k, "TFLOPs") for k in kinds] + [("lax uniform", "uniform", "lax_TFLOPs"),
                                                                  ("dense", "uniform", "dense_TFLOPs")]
        for i, (label, kind, key) in enumerate(series):
            vals = [next((r[key] or 0 for r in rows if r["problem"] == n and r["groups"] == kind and r["op"] == op), 0)
                    for n in names]
            width = 0.8 / len(series)
            ax.bar(x + (i - len(series) / 2 + 0.5) * width, vals, width, label=label)
        ax.set_xticks(x, [n.replace("_", "\n") for n in names], fontsize=8)
        ax.set(ylabel="TFLOP/s", title=f"{op} (bf16)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    dec = [r for r in rows if r["groups"].startswith("decode") and r["op"] == "ragged_dot"]
    for name in PROBLEMS:
        pts = sorted((int(r["groups"][6:]), r["us"] / r["memory_bound_us"]) for r in dec
                     if r["problem"] == name and r["us"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(1.0, color="k", lw=1)
    ax.set(xscale="log", xlabel="decode tokens T", ylabel="time / weight-read bound", title="decode forward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--problems", default=",".join(PROBLEMS))
    p.add_argument("--groups", default="uniform,skewed," + ",".join(f"decode{t}" for t in DECODE_TOKENS),
                   help="group-size kinds: uniform, skewed, decode<T>, routed<T>")
    p.add_argument("--quick", action="store_true", help="uniform and decode1 only")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--no-lax", action="store_true", help="skip jax.lax.ragged_dot (seconds a call on the large problems)")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    args, _ = p.parse_known_args(argv)
    ops = [o for o in args.ops.split(",") if o in OPS]
    kinds = ["uniform", "decode1"] if args.quick else args.groups.split(",")
    copy_tbps = copy_ceiling_tbps()
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); copy ceiling {copy_tbps:.2f} TB/s; "
          f"our kernels {'on' if jmp.grouped_gemm.kernels_available() else 'OFF (lax fallback)'}; "
          f"tokamax {'timed' if tokamax_ragged_dot() else 'not installed'}", flush=True)
    if not on_gpu():
        print("(CPU: wall-clock times of the fallback; the goals are for the H200)")
    print(HEADER)
    rows = []
    for name in args.problems.split(","):
        for kind in kinds:
            rows += bench_problem(name, kind, ops, copy_tbps, args.iterations, with_lax=not args.no_lax)
            save_rows(rows, args.json)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
