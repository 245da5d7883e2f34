"""A character-level language model on the Python standard library's .py sources, with our MoE
layer as the MLP of every block, against the same model with a dense MLP of equal active
parameters (a SwiGLU of width top_k * ffn_size), trained for the same steps.

    python examples/train_moe_lm.py            # GPU-sized run
    python examples/train_moe_lm.py --tiny     # about a minute on two CPU cores (CI)
    python examples/train_moe_lm.py --token-rounding 128   # also an MoE with token rounding
    python examples/train_moe_lm.py --data-parallel       # the batch split over every device

With --data-parallel the batch is split over a mesh axis of type Explicit (`jax.make_mesh`'s
default) spanning every device, the parameters replicated: each device runs the MoE layer on its
own tokens, and jax all-reduces the gradients.

Characters are UTF-8 bytes (vocabulary 256); the last 10% of the files are the validation split.
Prints both models' validation bits per character and training tokens per second (the steps after
the first, which compiles; the loss is read back every 10 steps) and writes a loss-curve PNG and a
JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from jax_moe_permute import TokenRounding
from jax_moe_permute.nnx import MoE

# layers, width, heads, experts, top_k, ffn_size, context, batch, steps, corpus bytes, and the
# matmuls' dtype (parameters, norms, router and loss stay float32): bf16 on the GPU, where the
# grouped GEMM kernels run.
CONFIGS = {
    "tiny": dict(layers=2, width=64, heads=4, experts=4, top_k=2, ffn=64, context=64, batch=16, steps=120,
                 corpus=1_000_000, dtype="float32"),
    # One pass over the 9.7 MB of training bytes: at 3000 steps of 64 (5 passes) both models
    # memorise the corpus (train loss 0.5 nats, validation 1.0) and the larger MoE overfits most.
    "gpu": dict(layers=6, width=384, heads=6, experts=8, top_k=2, ffn=768, context=256, batch=32, steps=1200,
                corpus=0, dtype="bfloat16"),
}


def load_corpus(max_bytes: int = 0):
    """(train, validation) uint8 arrays of the stdlib's .py files, split by file (last 10%)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if max_bytes and total >= max_bytes:
            break
    cut = max(1, int(0.9 * len(chunks)))
    as_array = lambda cs: np.frombuffer(b"".join(cs), np.uint8)
    return as_array(chunks[:cut]), as_array(chunks[cut:])


class Attention(nnx.Module):
    def __init__(self, width: int, heads: int, dtype, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(width, width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        B, T, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, D // self.heads), 3, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.reshape(B, T, D))


class DenseMLP(nnx.Module):
    """SwiGLU MLP: the dense baseline with the MoE's active parameters (width top_k * ffn)."""

    def __init__(self, width: int, ffn: int, dtype, *, rngs: nnx.Rngs):
        self.w_in = nnx.Linear(width, 2 * ffn, use_bias=False, dtype=dtype, rngs=rngs)
        self.w_out = nnx.Linear(ffn, width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.w_in(x), 2, axis=-1)
        return self.w_out(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    def __init__(self, c: dict, moe: bool, *, rngs: nnx.Rngs, token_rounding=None):
        self.norm1 = nnx.RMSNorm(c["width"], rngs=rngs)
        dtype = jnp.dtype(c["dtype"])
        self.attn = Attention(c["width"], c["heads"], dtype, rngs=rngs)
        self.norm2 = nnx.RMSNorm(c["width"], rngs=rngs)
        self.mlp = (MoE(c["width"], c["ffn"], c["experts"], c["top_k"], dtype=dtype, rngs=rngs,
                        token_rounding=token_rounding) if moe
                    else DenseMLP(c["width"], c["top_k"] * c["ffn"], dtype, rngs=rngs))

    def __call__(self, x):
        """(the block's output, the MoE layer's RouterAux or None for a dense MLP)."""
        x = x + self.attn(self.norm1(x))
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.norm2(x), return_aux=True)
        else:
            y, aux = self.mlp(self.norm2(x)), None
        return x + y, aux


def embed_lookup(table, tokens):
    """table[tokens]; where the tokens are split over Explicit mesh axes, the rows split the same
    way (jax asks a gather indexed by a sharded array for its result's sharding)."""
    sharding = jax.typeof(tokens).sharding
    if all(s is None for s in sharding.spec):
        return table[tokens]
    return table.at[tokens].get(out_sharding=sharding.update(spec=P(*sharding.spec, None)))


class LM(nnx.Module):
    def __init__(self, c: dict, moe: bool, *, rngs: nnx.Rngs, token_rounding=None):
        self.embed = nnx.Embed(256, c["width"], rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (c["context"], c["width"])))
        self.blocks = nnx.List([Block(c, moe, rngs=rngs, token_rounding=token_rounding) for _ in range(c["layers"])])
        self.norm = nnx.RMSNorm(c["width"], rngs=rngs)

    def __call__(self, tokens):
        """(logits, the RouterAux of each MoE layer)."""
        x = embed_lookup(self.embed.embedding[...], tokens) + self.pos[...][: tokens.shape[1]]
        auxes = []
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                auxes.append(aux)
        return self.embed.attend(self.norm(x)), auxes  # tied output embedding


def batches(data: np.ndarray, batch: int, context: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        window = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int32)
        yield window[:, :-1], window[:, 1:]


def loss_fn(model, x, y, aux_weight=1e-2, z_weight=1e-3):
    """(total loss, cross-entropy in nats): the MoE's balancing and z losses, summed over layers."""
    logits, auxes = model(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    extra = sum(aux_weight * a.load_balance_loss + z_weight * a.router_z_loss for a in auxes)
    return ce + extra, ce


def train(c: dict, moe: bool, train_data, val_data, seed: int = 0, log_every: int = 10, token_rounding=None,
          put=jnp.asarray):
    """Trains and evaluates one model; `put` places each batch (numpy) on the devices."""
    model = LM(c, moe, rngs=nnx.Rngs(seed), token_rounding=token_rounding)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, c["steps"] // 10), c["steps"], 3e-4)
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                 optax.adamw(schedule, weight_decay=0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y)
        optimizer.update(model, grads)
        return ce

    @nnx.jit
    def evaluate(model, x, y):
        return loss_fn(model, x, y)[1]

    rng = np.random.default_rng(seed)
    train_it = batches(train_data, c["batch"], c["context"], rng)
    curve = []
    start = time.perf_counter()
    for i in range(c["steps"]):
        ce = step(model, optimizer, *map(put, next(train_it)))
        if i == 0:  # the first step compiles: the rate counts the steps after it
            jax.block_until_ready(ce)
            compiled = time.perf_counter()
        if i % log_every == 0 or i == c["steps"] - 1:
            curve.append((i, float(ce)))
    trained = time.perf_counter()
    tokens_per_s = (c["steps"] - 1) * c["batch"] * c["context"] / max(trained - compiled, 1e-9)
    val_it = batches(val_data, c["batch"], c["context"], np.random.default_rng(seed + 1))
    val = float(np.mean([evaluate(model, *map(put, next(val_it))) for _ in range(32)]))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return dict(curve=curve, val_bpc=val / math.log(2), seconds=time.perf_counter() - start, params=int(params),
                compile_seconds=compiled - start, tokens_per_s=tokens_per_s)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        steps, ce = zip(*r["curve"])
        ax.plot(steps, np.array(ce) / math.log(2), label=f"{name} (val {r['val_bpc']:.3f} bpc)")
    ax.set(xlabel="step", ylabel="train bits per character", title="char-level LM on the stdlib sources")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and steps (about a minute)")
    p.add_argument("--steps", type=int, default=0, help="override the number of steps")
    p.add_argument("--batch", type=int, default=0, help="override the batch size (sequences)")
    p.add_argument("--out", default=".", help="directory for train_moe_lm.png / .json")
    p.add_argument("--token-rounding", default="", metavar="TILE[:MODE]",
                   help="also train the MoE with TokenRounding(TILE, MODE) (nearest, up or down; default nearest)")
    p.add_argument("--data-parallel", action="store_true",
                   help="split the batch over every device (a mesh axis of type Explicit)")
    args = p.parse_args(argv)
    c = dict(CONFIGS["tiny" if args.tiny else "gpu"])
    if args.steps:
        c["steps"] = args.steps
    if args.batch:
        c["batch"] = args.batch
    train_data, val_data = load_corpus(c["corpus"])
    passes = c["steps"] * c["batch"] * c["context"] / len(train_data)
    if args.data_parallel:
        if c["batch"] % jax.device_count():
            p.error(f"--data-parallel: the batch ({c['batch']}) must split evenly over {jax.device_count()} devices")
        c["data_parallel_devices"] = jax.device_count()
    print(f"backend {jax.default_backend()}; corpus {len(train_data)} train / {len(val_data)} validation bytes; "
          f"{c['steps']} steps of {c['batch']} x {c['context']}: {passes:.2f} passes over the training bytes")
    runs = [("moe", True, None), ("dense", False, None)]
    if args.token_rounding:
        tile, _, mode = args.token_rounding.partition(":")
        c["token_rounding"] = args.token_rounding
        runs.insert(1, ("moe_rounded", True, TokenRounding(int(tile), mode or "nearest")))
    results = {}
    put, mesh_scope = jnp.asarray, contextlib.nullcontext()
    if args.data_parallel:  # the batch split over every device, everything else replicated
        mesh_scope = jax.set_mesh(jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)))
        put = lambda a: jax.device_put(a, P("data"))
    with mesh_scope:
        for name, moe, rounding in runs:
            results[name] = r = train(c, moe, train_data, val_data, token_rounding=rounding, put=put)
            print(f"{name:11} params {r['params']:>9}  train loss {r['curve'][0][1]:.3f} -> {r['curve'][-1][1]:.3f} nats"
                  f"  val {r['val_bpc']:.3f} bpc  {r['tokens_per_s']:,.0f} tokens/s"
                  f"  ({r['seconds']:.1f} s, first step {r['compile_seconds']:.1f} s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_moe_lm.json"), "w") as f:
        json.dump(dict(config=c, results=results), f, indent=1)
    plot(results, os.path.join(args.out, "train_moe_lm.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
