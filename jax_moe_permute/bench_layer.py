"""Layer benchmark: the whole MoE layer (route, permute, grouped GEMMs, activation, unpermute),
ours against the same math in pure JAX and against dense GEMMs of the same FLOPs, in one run.

    python -m jax_moe_permute.bench --ops layer,layer_bwd [--model mixtral,qwen3,deepseek]
        [--tokens 1,64] [--no-split] [--ref-split] [--json out.json] [--plot out.png]

ours:      route -> moe_permute -> grouped GEMM (`jax_moe_permute.ragged_dot`) -> SwiGLU -> grouped GEMM
           -> moe_unpermute (`jax_moe_permute.moe_mlp`);
reference: route -> argsort + take -> jax.lax.ragged_dot -> SwiGLU -> jax.lax.ragged_dot ->
           gather + weighted sum (`layer.reference_moe_mlp`), the way JAX MoE code is written today;
dense:     [T*K, H] @ [H, 2F] -> SwiGLU -> @ [F, H], the expert GEMMs' FLOPs as two plain GEMMs.

FLOPs are the expert GEMMs' (6*T*K*H*F forward, twice that backward; the router's 2*T*H*E is
left out). `layer_bwd` times the backward pass alone (its vjp function is an argument of the
jitted call, as in bench.py). weight_bound_us moves weight_bytes at the run's copy bandwidth
(bench_timing.copy_ceiling_tbps): the weights of the experts the routing picks, read once, and for
layer_bwd every expert's dW written (the gradient is dense). The decode goal: us within 1.5x of
it at T = 1 and 64 (the `/bound` column).

--no-reference skips the pure-JAX layer ("skipped" in the table). Ours is also split by stage
(--no-split skips it; --ref-split splits the slow reference too), each stage timed alone on the
previous stage's outputs (forward, or that stage's backward for layer_bwd); where the forward
runs the fused first GEMM (sm_90, bf16/f16), its split times that path: "permute" the row ->
token index, "gemm_in" the kernel that gathers x and applies the activation, "activation" 0.
non_gemm_share is the split's share outside the two GEMMs (goal: <= 10% at T = 4096). A timing
that runs out of device memory (the reference's jax.lax.ragged_dot, which XLA lowers to a dense
product over a zero-padded copy, does for DeepSeek-V3) is None: "OOM" in the table, left out of
the plot.
Device time as in bench.py (bench_timing.device_us): CUPTI kernel time on GPU (a call over a
second: one wall-clock call), wall clock on CPU. On CPU the default model is "tiny" (the real
shapes take minutes a call there).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from . import gather_gemm, layer, reference
from .bench_timing import (cell, copy_ceiling_tbps, device_us_or_none, figure, none_if_out_of_memory, on_gpu,
                           progress, ratio, save_figure, save_rows, text_table)
from .grouped_gemm import ragged_dot
from . import ops as jmp_ops
from .routing import route
from .token_rounding import TokenRounding

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


def layer_route(x, router, K: int, token_rounding=None):
    """The benchmark's routing: softmax top-K of x @ router, token-rounded when asked."""
    return route(layer.router_logits(x, router), K, token_rounding=token_rounding)


def layer_fn(impl: str, K: int, token_rounding=None):
    """f(x, router, w_in, w_out) -> [T, H] (dense: f(x_dense, w_in0, w_out0) -> [T*K, H])."""
    if impl == "dense":
        return lambda x, w_in, w_out: layer.apply_activation(x @ w_in, "swiglu") @ w_out
    mlp = layer.moe_mlp if impl == "ours" else layer.reference_moe_mlp

    def f(x, router, w_in, w_out):
        r = layer_route(x, router, K, token_rounding)
        return mlp(x, r.weights, r.ids, w_in, w_out)

    return f


@none_if_out_of_memory
def timed(f, diff_args, const_args, ct, bwd: bool, iterations: int) -> float | None:
    """Device time of f(*diff_args, *const_args), or of its backward pass alone; None out of memory."""
    if not bwd:
        return device_us_or_none(jax.jit(f), *diff_args, *const_args, iterations=iterations)
    vjp = jax.vjp(jax.jit(lambda *d: f(*d, *const_args)), *diff_args)[1]  # runs the forward, untimed
    return device_us_or_none(jax.jit(lambda v, c: v(c)), vjp, ct, iterations=iterations)


@none_if_out_of_memory
def stage_split(impl: str, x, router, w_in, w_out, K: int, bwd: bool, iterations: int,
                token_rounding=None, fused: bool = False) -> dict | None:
    """Microseconds of each stage of `impl` ("ours" or "reference"), timed alone; `fused` (ours'
    forward where it runs the fused first GEMM, fuses_first_gemm): that path's stages."""
    E = w_in.shape[0]
    lib = jmp_ops if impl == "ours" else reference
    dot = ragged_dot if impl == "ours" else jax.lax.ragged_dot
    unpermute = lambda y, w, row_map: lib.moe_unpermute(y, row_map, w, out_dtype=x.dtype)
    stages = {
        "route": lambda x, router: layer_route(x, router, K, token_rounding).weights,
        "permute": lambda x, ids: lib.moe_permute(x, ids, E)[0],
        "gemm_in": lambda rows, w_in, gs: dot(rows, w_in, gs),
        "activation": lambda h: layer.apply_activation(h, "swiglu"),
        "gemm_out": lambda a, w_out, gs: dot(a, w_out, gs),
        "unpermute": unpermute,
    }
    r = jax.jit(lambda x, router: layer_route(x, router, K, token_rounding))(x, router)
    if fused:  # the row -> token index, then the kernel that gathers x and applies the activation
        stages["permute"] = lambda x, ids: layer.routing_rows(x, ids, E)[0]
        stages["gemm_in"] = lambda x, w_in, row_token, gs: gather_gemm.gather_gemm(x, row_token, gs, w_in,
                                                                                   activation="swiglu")[0]
        row_token, gs, row_map = jax.jit(lambda x, ids: layer.routing_rows(x, ids, E))(x, r.ids)
        a = jax.jit(stages["gemm_in"])(x, w_in, row_token, gs)
        first = {"permute": ((x,), (r.ids,), row_token), "gemm_in": ((x, w_in), (row_token, gs), a)}
    else:
        rows, gs, row_map = jax.jit(lambda x, ids: tuple(lib.moe_permute(x, ids, E)))(x, r.ids)
        h = jax.jit(stages["gemm_in"])(rows, w_in, gs)
        a = jax.jit(stages["activation"])(h)
        first = {"permute": ((x,), (r.ids,), rows), "gemm_in": ((rows, w_in), (gs,), h),
                 "activation": ((h,), (), a)}
    y = jax.jit(stages["gemm_out"])(a, w_out, gs)
    calls = {  # (diff args, const args, output for the cotangent's shape)
        "route": ((x, router), (), r.weights),
        **first,
        "gemm_out": ((a, w_out), (gs,), y),
        "unpermute": ((y, r.weights), (row_map,), x),
    }
    # fused: no activation stage (it runs in the first GEMM's epilogue)
    return {name: timed(stages[name], calls[name][0], calls[name][1], jnp.ones_like(calls[name][2]), bwd, iterations)
            if name in calls else 0.0 for name in STAGES}


def fuses_first_gemm(x, ids, w_in, bwd: bool) -> bool:
    """Whether `moe_mlp`'s timed pass runs the fused first GEMM (its forward on sm_90, bf16/f16)."""
    return not bwd and layer.gathers_rows(x, ids, w_in, "swiglu")


def non_gemm_share(split: dict | None) -> float | None:
    """Share of the split's time outside the two grouped GEMMs (None where a stage is)."""
    if split is None or None in split.values():
        return None
    return 1 - (split["gemm_in"] + split["gemm_out"]) / sum(split.values())


def routed_experts(x, router, K: int, token_rounding=None) -> int:
    """How many distinct experts the layer's routing picks for x (the weights decode must read)."""
    ids = np.asarray(jax.jit(lambda x, router: layer_route(x, router, K, token_rounding).ids)(x, router))
    return int(np.unique(ids[ids >= 0]).size)


def weight_bytes(op: str, routed: int, E: int, H: int, F: int, itemsize: int) -> int:
    """The fewest expert-weight bytes the timed pass moves: w_in [H, 2F] and w_out [F, H] of the
    routed experts read once (the backward reads them for the input gradient only), and for
    layer_bwd dW written for all E experts (zeros for the unrouted ones, still written)."""
    per_expert = 3 * H * F * itemsize
    return routed * per_expert + (E * per_expert if op == "layer_bwd" else 0)


def bench_shape(model: str, T: int, ops, copy_tbps: float, iterations: int = 20, dtype=jnp.bfloat16,
                split: bool = True, ref_split: bool = False, with_reference: bool = True, token_rounding=None):
    E, K, H, F = MODELS[model]
    inp = layer_inputs(model, T, dtype)
    moe_args = (inp["x"], inp["router"], inp["w_in"], inp["w_out"])
    routed = routed_experts(inp["x"], inp["router"], K, token_rounding)
    ids = jax.eval_shape(lambda x, router: layer_route(x, router, K, token_rounding).ids, inp["x"], inp["router"])
    flops_fwd = 6 * T * K * H * F
    rows = []
    for op in ops:
        bwd = op == "layer_bwd"
        flops = flops_fwd * (2 if bwd else 1)
        times = {impl: timed(layer_fn(impl, K, token_rounding), moe_args, (), inp["ct"], bwd, iterations)
                 for impl in ("ours", "reference") if impl == "ours" or with_reference}
        times.setdefault("reference", None)
        times["dense"] = timed(layer_fn("dense", K), (inp["x_dense"], inp["w_in"][0], inp["w_out"][0]), (),
                               inp["ct_dense"], bwd, iterations)
        nbytes = weight_bytes(op, routed, E, H, F, jnp.dtype(dtype).itemsize)
        bound_us = nbytes / copy_tbps / 1e6
        row = dict(model=model, T=T, E=E, K=K, H=H, F=F, op=op, flops=flops, us=times["ours"],
                   ref_us=times["reference"], dense_us=times["dense"],
                   speedup=ratio(times["reference"], times["ours"]),
                   **{f"{k}TFLOPs": ratio(flops / 1e6, times[impl]) for k, impl in
                      (("", "ours"), ("ref_", "reference"), ("dense_", "dense"))},
                   routed_experts=routed, weight_bytes=nbytes, weight_bound_us=bound_us, copy_TBps=copy_tbps,
                   ref_skipped=not with_reference,
                   token_rounding=None if token_rounding is None else token_rounding._asdict())
        if split:
            fused = fuses_first_gemm(inp["x"], ids, inp["w_in"], bwd)
            row["split_us"] = stage_split("ours", *moe_args, K, bwd, iterations, token_rounding, fused)
            row["non_gemm_share"] = non_gemm_share(row["split_us"])
            row["split_fused_first_gemm"] = fused
        if ref_split:
            row["ref_split_us"] = stage_split("reference", *moe_args, K, bwd, iterations, token_rounding)
        rows.append(row)
    return rows


HEADER = (f"{'model':9} {'T':>6} {'op':10} {'us':>10} {'ref us':>10} {'dense us':>10} {'speed-up':>8} "
          f"{'TFLOP/s':>8} {'ref':>7} {'dense':>7} {'/bound':>7} {'non-GEMM':>8}  split (ours, us): "
          + " / ".join(STAGES))


def format_row(r) -> str:
    if "split_us" not in r:
        split = ""
    elif r["split_us"] is None:
        split = "OOM"
    else:
        split = " / ".join(cell(r["split_us"][s], ".1f", "OOM") for s in STAGES)
        if r.get("split_fused_first_gemm"):
            split += " (fused first GEMM: permute = row index, gemm_in = gather + GEMM + activation)"
    share = r.get("non_gemm_share")
    return (f"{r['model']:9} {r['T']:>6} {r['op']:10} {cell(r['us'], '10.1f', 'OOM')} "
            f"{cell(r['ref_us'], '10.1f', 'skipped' if r.get('ref_skipped') else 'OOM')} "
            f"{cell(r['dense_us'], '10.1f', 'OOM')} "
            f"{cell(r['speedup'], '7.2f')}{'x' if r['speedup'] is not None else ' '} "
            f"{cell(r['TFLOPs'], '8.1f')} {cell(r['ref_TFLOPs'], '7.1f')} {cell(r['dense_TFLOPs'], '7.1f')} "
            f"{cell(ratio(r['us'], r['weight_bound_us']), '7.2f')} "
            f"{cell(None if share is None else 100 * share, '7.1f')}{'%' if share is not None else ' '}  {split}")


def format_table(rows) -> str:
    return text_table(HEADER, map(format_row, rows))


def plot(rows, path: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = figure(2, len(models), 5, 4)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        ax = axes[0][col]
        for op in dict.fromkeys(r["op"] for r in mine):
            series = sorted((r for r in mine if r["op"] == op), key=lambda r: r["T"])
            color = None
            for key, label, style in (("TFLOPs", "ours", dict(marker="o")),
                                      ("ref_TFLOPs", "pure JAX", dict(marker="x", ls="--")),
                                      ("dense_TFLOPs", "dense GEMMs", dict(ls=":"))):
                pts = [(r["T"], r[key]) for r in series if r[key] is not None]  # out of memory: no point
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=f"{op} {label}",
                                **style)
                color = line.get_color()
        ax.set(xscale="log", xlabel="tokens T", ylabel="TFLOP/s", title=model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]  # where ours spends its forward time, by T
        fwd = sorted((r for r in mine if r["op"] == "layer" and r.get("non_gemm_share") is not None),
                     key=lambda r: r["T"])
        bottom = np.zeros(len(fwd))
        for stage in STAGES:
            share = np.array([r["split_us"][stage] / sum(r["split_us"].values()) for r in fwd])
            ax.bar([str(r["T"]) for r in fwd], share, bottom=bottom, label=stage)
            bottom += share
        ax.set(xlabel="tokens T", ylabel="share of forward time (ours)")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tokens 1, 64 only")
    p.add_argument("--model", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--tokens", default="", help="comma-separated token counts (overrides the grid)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--no-split", action="store_true", help="skip the per-stage time split of ours")
    p.add_argument("--ref-split", action="store_true", help="split the reference by stage too (slow)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the pure-JAX layer (minutes a call at T = 16384)")
    p.add_argument("--token-rounding", default="", metavar="TILE[:MODE]",
                   help="route with TokenRounding(TILE, MODE) (MODE nearest, up or down; default nearest)")
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--plot", default="", help="write a PNG plot here")
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    bad = [op for op in ops if op not in OPS]
    if bad:
        p.error(f"the layer benchmark runs {', '.join(OPS)}; got {', '.join(bad)}")
    default_models = "mixtral,qwen3,deepseek" if on_gpu() else "tiny"
    tokens = TOKENS if on_gpu() else CPU_TOKENS
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    elif args.quick:
        tokens = (1, 64)
    token_rounding = None
    if args.token_rounding:
        tile, _, mode = args.token_rounding.partition(":")
        token_rounding = TokenRounding(int(tile), mode or "nearest")
    copy_tbps = copy_ceiling_tbps()
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); copy ceiling {copy_tbps:.3g} TB/s",
          flush=True)
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    jobs = [(m, t) for m in (args.model or default_models).split(",") for t in tokens]
    for model, T in progress(jobs):
        new = bench_shape(model, T, ops, copy_tbps, iterations=args.iterations, split=not args.no_split,
                          ref_split=args.ref_split, with_reference=not args.no_reference,
                          token_rounding=token_rounding)
        rows += new
        save_rows(rows, args.json)
        for r in new:  # as measured, so a run cut short still shows its rows
            print(format_row(r), flush=True)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
