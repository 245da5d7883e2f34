"""Layer benchmark: the whole MoE layer (route, permute, grouped GEMMs, activation, unpermute),
ours against the same math in pure JAX and against dense GEMMs of the same FLOPs, in one run.

    python -m jax_moe_permute.bench --ops layer,layer_bwd [--model mixtral,qwen3,deepseek]
                                    [--tokens 1,64] [--json out.json] [--plot out.png]

ours:      route -> moe_permute -> grouped GEMM (`jax_moe_permute.ragged_dot`) -> SwiGLU -> grouped GEMM
           -> moe_unpermute (`jax_moe_permute.moe_mlp`);
reference: route -> argsort + take -> jax.lax.ragged_dot -> SwiGLU -> jax.lax.ragged_dot ->
           gather + weighted sum (`layer.reference_moe_mlp`), the way JAX MoE code is written today;
dense:     [T*K, H] @ [H, 2F] -> SwiGLU -> @ [F, H], the expert GEMMs' FLOPs as two plain GEMMs.

FLOPs are the expert GEMMs' (6*T*K*H*F forward, twice that backward; the router's 2*T*H*E is
left out). `layer_bwd` times the backward pass alone (its vjp function is an argument of the
jitted call, as in bench.py). Each row also splits ours and the reference by stage, each stage
timed alone on the previous stage's outputs (forward, or that stage's backward for layer_bwd).
Device time as in bench.py: CUPTI kernel time on GPU, wall clock on CPU. On CPU the default model
is "tiny" (the real shapes take minutes a call there).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from . import bench, layer, reference
from .grouped_gemm import ragged_dot
from . import ops as jmp_ops
from .routing import route

MODELS = {  # name: (E, K, H, F)
    "mixtral": (8, 2, 4096, 14336),
    "qwen3": (128, 8, 2048, 768),
    "deepseek": (256, 8, 7168, 2048),
    "tiny": (8, 2, 64, 96),  # CPU / CI
}
TOKENS = (1, 64, 4096, 16384)
CPU_TOKENS = (1, 64, 256)
OPS = ("layer", "layer_bwd")
STAGES = ("route", "permute", "gemm_in", "activation", "gemm_out", "unpermute")


def layer_inputs(model: str, T: int, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    E, K, H, F = MODELS[model]
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    normal = lambda key, shape, scale: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
    return dict(x=normal(k[0], (T, H), 1.0), router=normal(k[1], (H, E), H ** -0.5),
                w_in=normal(k[2], (E, H, 2 * F), H ** -0.5), w_out=normal(k[3], (E, F, H), F ** -0.5),
                x_dense=normal(k[4], (T * K, H), 1.0), ct=normal(k[5], (T, H), 1.0),
                ct_dense=normal(k[5], (T * K, H), 1.0))


def layer_fn(impl: str, K: int):
    """f(x, router, w_in, w_out) -> [T, H] (dense: f(x_dense, w_in0, w_out0) -> [T*K, H])."""
    if impl == "dense":
        return lambda x, w_in, w_out: layer.apply_activation(x @ w_in, "swiglu") @ w_out
    mlp = layer.moe_mlp if impl == "ours" else layer.reference_moe_mlp

    def f(x, router, w_in, w_out):
        r = route(layer.router_logits(x, router), K)
        return mlp(x, r.weights, r.ids, w_in, w_out)

    return f


def timed(f, diff_args, const_args, ct, bwd: bool, iterations: int) -> float:
    """Device time of f(*diff_args, *const_args), or of its backward pass alone."""
    if not bwd:
        return bench.device_us(jax.jit(f), *diff_args, *const_args, iterations=iterations)
    vjp = jax.vjp(jax.jit(lambda *d: f(*d, *const_args)), *diff_args)[1]
    return bench.device_us(jax.jit(lambda v, c: v(c)), vjp, ct, iterations=iterations)


def stage_split(impl: str, x, router, w_in, w_out, K: int, bwd: bool, iterations: int) -> dict:
    """Microseconds of each stage of `impl` ("ours" or "reference"), timed alone."""
    E = w_in.shape[0]
    lib = jmp_ops if impl == "ours" else reference
    dot = ragged_dot if impl == "ours" else jax.lax.ragged_dot
    unpermute = lambda y, w, row_map: lib.moe_unpermute(y, row_map, w, out_dtype=x.dtype)
    stages = {
        "route": lambda x, router: route(layer.router_logits(x, router), K).weights,
        "permute": lambda x, ids: lib.moe_permute(x, ids, E)[0],
        "gemm_in": lambda rows, w_in, gs: dot(rows, w_in, gs),
        "activation": lambda h: layer.apply_activation(h, "swiglu"),
        "gemm_out": lambda a, w_out, gs: dot(a, w_out, gs),
        "unpermute": unpermute,
    }
    r = jax.jit(lambda x, router: route(layer.router_logits(x, router), K))(x, router)
    rows, gs, row_map = jax.jit(lambda x, ids: tuple(lib.moe_permute(x, ids, E)))(x, r.ids)
    h = jax.jit(stages["gemm_in"])(rows, w_in, gs)
    a = jax.jit(stages["activation"])(h)
    y = jax.jit(stages["gemm_out"])(a, w_out, gs)
    calls = {  # (diff args, const args, output for the cotangent's shape)
        "route": ((x, router), (), r.weights),
        "permute": ((x,), (r.ids,), rows),
        "gemm_in": ((rows, w_in), (gs,), h),
        "activation": ((h,), (), a),
        "gemm_out": ((a, w_out), (gs,), y),
        "unpermute": ((y, r.weights), (row_map,), x),
    }
    out = {}
    for name in STAGES:
        diff, const, like = calls[name]
        ct = jnp.ones_like(like)
        out[name] = timed(stages[name], diff, const, ct, bwd, iterations)
    return out


def bench_shape(model: str, T: int, ops, iterations: int = 20, dtype=jnp.bfloat16, split: bool = True):
    E, K, H, F = MODELS[model]
    inp = layer_inputs(model, T, dtype)
    flops_fwd = 6 * T * K * H * F
    rows = []
    for op in ops:
        bwd = op == "layer_bwd"
        flops = flops_fwd * (2 if bwd else 1)
        moe_args = (inp["x"], inp["router"], inp["w_in"], inp["w_out"])
        times = {impl: timed(layer_fn(impl, K), moe_args, (), inp["ct"], bwd, iterations)
                 for impl in ("ours", "reference")}
        times["dense"] = timed(layer_fn("dense", K), (inp["x_dense"], inp["w_in"][0], inp["w_out"][0]), (),
                               inp["ct_dense"], bwd, iterations)
        row = dict(model=model, T=T, E=E, K=K, H=H, F=F, op=op, flops=flops, us=times["ours"],
                   ref_us=times["reference"], dense_us=times["dense"],
                   **{f"{k}TFLOPs": flops / times[impl] / 1e6 for k, impl in
                      (("", "ours"), ("ref_", "reference"), ("dense_", "dense"))})
        if split:
            row["split_us"] = stage_split("ours", *moe_args, K, bwd, iterations)
            row["ref_split_us"] = stage_split("reference", *moe_args, K, bwd, iterations)
        rows.append(row)
    return rows


def format_table(rows) -> str:
    head = (f"{'model':9} {'T':>6} {'op':10} {'us':>10} {'ref us':>10} {'dense us':>10} {'speed-up':>8} "
            f"{'TFLOP/s':>8} {'ref':>7} {'dense':>7}  split (ours, us): " + " / ".join(STAGES))
    lines = [head, "-" * len(head)]
    for r in rows:
        split = " / ".join(f"{r['split_us'][s]:.1f}" for s in STAGES) if "split_us" in r else ""
        lines.append(f"{r['model']:9} {r['T']:>6} {r['op']:10} {r['us']:10.1f} {r['ref_us']:10.1f} "
                     f"{r['dense_us']:10.1f} {r['ref_us'] / r['us']:7.2f}x {r['TFLOPs']:8.1f} "
                     f"{r['ref_TFLOPs']:7.1f} {r['dense_TFLOPs']:7.1f}  {split}")
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        ax = axes[0][col]
        for op in dict.fromkeys(r["op"] for r in mine):
            pts = sorted((r["T"], r["TFLOPs"], r["ref_TFLOPs"], r["dense_TFLOPs"]) for r in mine if r["op"] == op)
            T = [p[0] for p in pts]
            line, = ax.plot(T, [p[1] for p in pts], marker="o", label=f"{op} ours")
            ax.plot(T, [p[2] for p in pts], marker="x", ls="--", color=line.get_color(), label=f"{op} pure JAX")
            ax.plot(T, [p[3] for p in pts], ls=":", color=line.get_color(), label=f"{op} dense GEMMs")
        ax.set(xscale="log", xlabel="tokens T", ylabel="TFLOP/s", title=model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]  # where ours spends its forward time, by T
        fwd = sorted((r for r in mine if r["op"] == "layer" and "split_us" in r), key=lambda r: r["T"])
        bottom = np.zeros(len(fwd))
        for stage in STAGES:
            share = np.array([r["split_us"][stage] / sum(r["split_us"].values()) for r in fwd])
            ax.bar([str(r["T"]) for r in fwd], share, bottom=bottom, label=stage)
            bottom += share
        ax.set(xlabel="tokens T", ylabel="share of forward time (ours)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tokens 1, 64 only")
    p.add_argument("--model", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--tokens", default="", help="comma-separated token counts (overrides the grid)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--no-split", action="store_true", help="skip the per-stage time split")
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--plot", default="", help="write a PNG plot here")
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    bad = [op for op in ops if op not in OPS]
    if bad:
        p.error(f"the layer benchmark runs {', '.join(OPS)}; got {', '.join(bad)}")
    default_models = "mixtral,qwen3,deepseek" if bench.on_gpu() else "tiny"
    tokens = TOKENS if bench.on_gpu() else CPU_TOKENS
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    elif args.quick:
        tokens = (1, 64)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
    rows = []
    jobs = [(m, t) for m in (args.model or default_models).split(",") for t in tokens]
    for model, T in bench.progress(jobs):
        rows += bench_shape(model, T, ops, iterations=args.iterations, split=not args.no_split)
        bench.save_rows(rows, args.json)
    print(format_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
