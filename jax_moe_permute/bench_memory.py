"""Memory benchmark: what one layer keeps for its backward, against a dense SwiGLU MLP of the same
active width (K*F), and the compiled peak memory of one layer's `jit(grad)`.

    python -m jax_moe_permute.bench --ops layer_memory [--model mixtral,qwen3,deepseek]
        [--tokens 16384] [--json out.json]

saved bytes / token: the arrays that `jax.vjp` keeps (the leaves of its backward function),
counted from shapes alone (`jax.eval_shape`, nothing is allocated) at two token counts; the
difference over the token difference drops what does not grow with T (the weights).
ours:      route + `moe_mlp` (bench_layer.layer_fn("ours"));
reference: route + `layer.reference_moe_mlp` (pure JAX);
dense:     x [T, H] @ [H, 2KF] -> SwiGLU -> @ [KF, H], the dense MLP of the experts' active width.
peak:      `jit(grad)` of each at T tokens, compiled but not run: XLA's temporary buffers
           (memory_analysis().temp_size_in_bytes) and its arguments plus outputs.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from . import layer
from .bench_layer import MODELS, layer_fn
from .bench_timing import cell, none_if_out_of_memory, on_gpu, progress, ratio, save_rows

OPS = ("layer_memory",)
IMPLS = ("ours", "reference", "dense")
PROBE_TOKENS = (256, 512)


def dense_mlp(x, w_in, w_out):
    return layer.apply_activation(x @ w_in, "swiglu") @ w_out


def layer_specs(impl: str, model: str, T: int, dtype=jnp.bfloat16):
    """(f, argument shapes) of one layer: f(x, router, w_in, w_out) or, dense, f(x, w_in, w_out)."""
    E, K, H, F = MODELS[model]
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    if impl == "dense":
        return dense_mlp, (spec(T, H), spec(H, 2 * K * F), spec(K * F, H))
    return layer_fn(impl, K), (spec(T, H), spec(H, E), spec(E, H, 2 * F), spec(E, F, H))


def saved_bytes(f, specs) -> int:
    """Bytes of the residuals jax.vjp(f) keeps for its backward (from shapes; nothing runs)."""
    backward = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *specs)
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(backward))


def saved_bytes_per_token(impl: str, model: str) -> float:
    (t0, b0), (t1, b1) = [(T, saved_bytes(*layer_specs(impl, model, T))) for T in PROBE_TOKENS]
    return (b1 - b0) / (t1 - t0)


@none_if_out_of_memory
def compiled_grad(f, specs):
    """jit(grad) of sum(f) compiled for specs; None where compiling runs out of device memory (XLA's
    GPU autotuner runs candidate kernels: the pure-JAX ragged_dot's dense expansion asks for 64 GiB
    at Qwen3's T = 16384)."""
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(specs))))).lower(*specs).compile()


def grad_peak_bytes(impl: str, model: str, T: int) -> dict:
    compiled = compiled_grad(*layer_specs(impl, model, T))
    stats = None if compiled is None else compiled.memory_analysis()
    if stats is None:  # out of memory, or a backend without memory statistics
        return dict(temp_bytes=None, io_bytes=None)
    return dict(temp_bytes=int(stats.temp_size_in_bytes),
                io_bytes=int(stats.argument_size_in_bytes + stats.output_size_in_bytes))


def bench_model(model: str, T: int) -> dict:
    E, K, H, F = MODELS[model]
    row = dict(model=model, T=T, E=E, K=K, H=H, F=F)
    for impl in IMPLS:
        row[f"{impl}_saved_per_token"] = saved_bytes_per_token(impl, model)
        peak = grad_peak_bytes(impl, model, T)
        row[f"{impl}_temp_bytes"], row[f"{impl}_io_bytes"] = peak["temp_bytes"], peak["io_bytes"]
    row["saved_vs_dense"] = ratio(row["ours_saved_per_token"], row["dense_saved_per_token"])
    row["temp_vs_dense"] = ratio(row["ours_temp_bytes"], row["dense_temp_bytes"])
    return row


HEADER = (f"{'model':9} {'T':>6}  saved KB/token: {'ours':>7} {'ref':>7} {'dense':>7} {'/dense':>6}   "
          f"grad temp MiB: {'ours':>8} {'ref':>8} {'dense':>8} {'/dense':>6}")


def format_row(r) -> str:
    kb = lambda impl: cell(r[f"{impl}_saved_per_token"] / 1e3, "7.1f")
    mib = lambda impl: cell(None if r[f"{impl}_temp_bytes"] is None else r[f"{impl}_temp_bytes"] / 2**20, "8.0f")
    return (f"{r['model']:9} {r['T']:>6}  {'':15} {kb('ours')} {kb('reference')} {kb('dense')} "
            f"{cell(r['saved_vs_dense'], '6.2f')}   {'':14} {mib('ours')} {mib('reference')} {mib('dense')} "
            f"{cell(r['temp_vs_dense'], '6.2f')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--model", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--tokens", default="", help="comma-separated token counts for the peak (default 16384)")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    models = (args.model or ("mixtral,qwen3,deepseek" if on_gpu() else "tiny")).split(",")
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (16384,)
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    for model, T in progress([(m, t) for m in models for t in tokens]):
        rows.append(bench_model(model, T))
        save_rows(rows, args.json)
        print(format_row(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
