"""Expert-parallel layer benchmark: one MoE layer spread over every device, against the same layer
on one device and against its traffic at the link bandwidth measured in the same run.

    python -m jax_moe_permute.bench --ops ep [--model qwen3,mixtral,deepseek] [--tokens 4096]
        [--dispatch all_gather,all_to_all,data_parallel] [--iterations 10] [--json out.json]

ep:      D = jax.device_count() devices on one mesh axis, E / D experts and T tokens each:
         route(router_logits(x, router)) -> `parallel.moe_ep` with `layer.expert_mlp` (two
         `ragged_dot`s and SwiGLU) as expert_fn, inside `jax.shard_map`; forward, and
         forward+backward (`jax.grad` of a sum over x, w_in and w_out).
data_parallel: the same D*T tokens split over the devices of an Explicit mesh axis, every expert
         on every device: route + `moe_mlp` under jax.jit, which runs each device's own tokens.
one:     the same layer (route + `moe_mlp`) on one device holding every expert, T tokens.
scaling: one / ep time: the ep layer's token throughput (D*T tokens a call) over D times the
         one-device layer's (1.0: D devices go D times as fast; the goal is >= 0.8).
sent:    bytes the busiest device sends in the forward (docs/parallel.md, "Bytes per layer"):
         all_gather (D-1)*T*(H*b + K*(4 + b_w) + H*b); all_to_all, ragged, S*2*H*b + (D-1)*E*4
         with S the device's entries routed to other devices' experts (from the routing);
         all_to_all, dense (XLA:CPU) (D-1)*T*K*2*H*b + (D-1)*E*4. The backward sends as much again.
         data_parallel: the routing's ids gathered for the expert counts, (D-1)*T*K*4, and the
         router's mean probabilities all-reduced, 2*(D-1)/D*E*4; the backward all-reduces the
         gradients of w_in and w_out, 2*(D-1)/D*3*E*H*F*b (a ring).
link:    what one device sends per second in a tiled `all_gather` of a large buffer,
         (D-1)*N bytes for N bytes a device, timed in the same run; link_us = sent / link for the
         forward and (forward + backward bytes) / link for forward+backward. None with one device.
Times are wall clock, median of `iterations` calls after a warm-up (block_until_ready): CUPTI's
kernel sum (bench_timing.device_us) does not describe several devices working at once. On CPU
the default model is "tiny"; run with XLA_FLAGS=--xla_force_host_platform_device_count=8 to
try several devices there.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import layer, parallel
from .bench_layer import MODELS, layer_fn
from .bench_timing import cell, on_gpu, progress, ratio, save_rows, wall_us
from .routing import route

OPS = ("ep",)
AXIS = "ep"
GPU_MODELS = ("mixtral", "qwen3", "deepseek")
DISPATCHES = ("all_gather", "all_to_all", "data_parallel")
DATA_PARALLEL = "data_parallel"  # not a moe_ep dispatch: moe_mlp on tokens split over an Explicit axis
LINK_BYTES = {True: 256 * 2**20, False: 8 * 2**20}  # per device, on GPU / elsewhere


def make_mesh():
    return jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def link_tbps(mesh, iterations: int) -> float | None:
    """Bytes a device sends per second (TB/s) in a tiled all_gather of LINK_BYTES a device."""
    D = mesh.size
    if D == 1:
        return None
    n = LINK_BYTES[on_gpu()]
    x = jax.device_put(jnp.ones((D * n // 4,), jnp.float32), NamedSharding(mesh, P(AXIS)))
    gather = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, AXIS, tiled=True), mesh=mesh,
                                   in_specs=P(AXIS), out_specs=P(AXIS)))
    return (D - 1) * n / wall_us(gather, x, iterations=iterations) / 1e6


def ep_layer(mesh, dispatch: str, E: int, K: int):
    """f(x, router, w_in, w_out) -> [D*T, H]: each device routes and runs its tokens through moe_ep."""

    def body(x, router, w_in, w_out):
        r = route(layer.router_logits(x, router), K)
        experts = lambda rows, group_sizes: layer.expert_mlp(rows, group_sizes, w_in, w_out, "swiglu")
        return parallel.moe_ep(x, r.ids, r.weights, experts, num_experts=E, axis_name=AXIS, dispatch=dispatch)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS), P(AXIS)), out_specs=P(AXIS))


def forward_backward(f):
    """jit(grad) of a sum of f's output over x, w_in and w_out."""
    loss = lambda x, router, w_in, w_out: jnp.sum(f(x, router, w_in, w_out).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 2, 3)))


def ragged_exchange(dispatch: str) -> bool:
    """Whether `dispatch` sends rows with ragged_all_to_all here (else dense blocks, or none)."""
    return dispatch == "ragged_all_to_all" or (
        dispatch == "all_to_all" and jax.default_backend() in parallel.RAGGED_ALL_TO_ALL_BACKENDS)


def sent_bytes(dispatch: str, ids: np.ndarray, D: int, E: int, H: int, F: int, itemsize: int,
               ragged: bool) -> tuple[int, int]:
    """(forward, backward) bytes the busiest device sends (docs/parallel.md's table; ids
    [D*T, K] global, float32 router weights)."""
    T, K = ids.shape[0] // D, ids.shape[1]
    if D == 1:
        return 0, 0
    if dispatch == DATA_PARALLEL:
        ring = lambda n: 2 * (D - 1) * n // D  # what a device sends in a ring all-reduce of n bytes
        return (D - 1) * T * K * 4 + ring(E * 4), ring(3 * E * H * F * itemsize)
    if dispatch == "all_gather":
        sent = (D - 1) * T * (H * itemsize + K * (4 + 4) + H * itemsize)
        return sent, sent
    counts = (D - 1) * E * 4
    if not ragged:
        sent = (D - 1) * T * K * 2 * H * itemsize + counts
        return sent, sent
    L = E // D
    owner = np.where((ids >= 0) & (ids < E), ids // L, -1).reshape(D, T, K)
    leaving = owner != np.arange(D)[:, None, None]
    S = int(((owner >= 0) & leaving).reshape(D, -1).sum(axis=1).max())
    sent = S * 2 * H * itemsize + counts
    return sent, sent


def bench_point(name: str, T: int, mesh, link, dispatches, iterations: int, dtype=jnp.bfloat16) -> list[dict]:
    E, K, H, F = MODELS[name]
    D = mesh.size
    ks = jax.random.split(jax.random.key(0), 4)
    shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x = jax.random.normal(ks[0], (D * T, H), dtype)
    router = (jax.random.normal(ks[1], (H, E), jnp.float32) * H ** -0.5).astype(dtype)
    w_in = (jax.random.normal(ks[2], (E, H, 2 * F), jnp.float32) * H ** -0.5).astype(dtype)
    w_out = (jax.random.normal(ks[3], (E, F, H), jnp.float32) * F ** -0.5).astype(dtype)
    ids = np.asarray(jax.jit(lambda x, r: route(layer.router_logits(x, r), K).ids)(x, router))

    one_args = tuple(jax.device_put(a, jax.devices()[0]) for a in (x[:T], router, w_in, w_out))
    one = layer_fn("ours", K)  # route + moe_mlp
    one_fwd = wall_us(jax.jit(one), *one_args, iterations=iterations)
    one_fwd_bwd = wall_us(forward_backward(one), *one_args, iterations=iterations)
    del one_args

    args = (shard(x, P(AXIS)), shard(router, P()), shard(w_in, P(AXIS)), shard(w_out, P(AXIS)))
    rows = []
    for dispatch in dispatches:
        if dispatch == DATA_PARALLEL:
            explicit = jax.make_mesh((D,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
            with jax.set_mesh(explicit):
                dp_args = [jax.device_put(a, NamedSharding(explicit, P(AXIS) if i == 0 else P()))
                           for i, a in enumerate((x, router, w_in, w_out))]
                fwd = wall_us(jax.jit(one), *dp_args, iterations=iterations)
                fwd_bwd = wall_us(forward_backward(one), *dp_args, iterations=iterations)
            del dp_args
        else:
            f = ep_layer(mesh, dispatch, E, K)
            fwd = wall_us(jax.jit(f), *args, iterations=iterations)
            fwd_bwd = wall_us(forward_backward(f), *args, iterations=iterations)
        ragged = ragged_exchange(dispatch)
        sent, sent_bwd = sent_bytes(dispatch, ids, D, E, H, F, jnp.dtype(dtype).itemsize, ragged)
        link_us = None if link is None else sent / link / 1e6
        link_fwd_bwd_us = None if link is None else (sent + sent_bwd) / link / 1e6
        rows.append(dict(
            model=name, D=D, T=T, dispatch=dispatch, ragged=ragged, backend=jax.default_backend(), E=E, K=K, H=H,
            F=F, fwd_us=fwd, fwd_bwd_us=fwd_bwd, one_fwd_us=one_fwd, one_fwd_bwd_us=one_fwd_bwd,
            scaling_fwd=one_fwd / fwd, scaling_fwd_bwd=one_fwd_bwd / fwd_bwd,
            tokens_per_s_fwd_bwd=D * T / fwd_bwd * 1e6, sent_bytes=sent, sent_bwd_bytes=sent_bwd, link_TBps=link,
            link_us=link_us, link_share_fwd=ratio(link_us, fwd), link_share_fwd_bwd=ratio(link_fwd_bwd_us, fwd_bwd)))
    return rows


HEADER = (f"{'model':10} {'D':>2} {'T':>6} {'dispatch':13} {'fwd us':>9} {'f+b us':>9} {'one fwd':>9} "
          f"{'one f+b':>9} {'scale f':>7} {'scale fb':>8} {'sent MB':>8} {'link us':>8} {'link/fb':>7}")


def format_row(r: dict) -> str:
    return (f"{r['model']:10} {r['D']:2d} {r['T']:6d} {r['dispatch']:13} {r['fwd_us']:9.1f} {r['fwd_bwd_us']:9.1f} "
            f"{r['one_fwd_us']:9.1f} {r['one_fwd_bwd_us']:9.1f} {r['scaling_fwd']:7.2f} {r['scaling_fwd_bwd']:8.2f} "
            f"{r['sent_bytes'] / 1e6:8.2f} {cell(r['link_us'], '8.1f')} {cell(r['link_share_fwd_bwd'], '7.2f')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="ep")
    p.add_argument("--model", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--tokens", default="4096", help="comma-separated tokens per device")
    p.add_argument("--dispatch", default=",".join(DISPATCHES), help="comma-separated subset of "
                   + ",".join(parallel.DISPATCHES + (DATA_PARALLEL,)))
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    if args.ops.split(",") != list(OPS):
        p.error(f"the expert-parallel benchmark runs {', '.join(OPS)} alone; got {args.ops}")
    names = (args.model or ",".join(GPU_MODELS if on_gpu() else ("tiny",))).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    dispatches = args.dispatch.split(",")
    choices = parallel.DISPATCHES + (DATA_PARALLEL,)
    if set(dispatches) - set(choices):
        p.error(f"unknown dispatch in {args.dispatch}; choose from {', '.join(choices)}")
    mesh = make_mesh()
    link = link_tbps(mesh, args.iterations)
    print(f"backend {jax.default_backend()}, {mesh.size} device(s) ({jax.devices()[0].device_kind}); all_gather "
          f"link {cell(link, '.3g')} TB/s sent per device", flush=True)
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    for name, T in progress([(n, int(t)) for n in names for t in args.tokens.split(",")]):
        if MODELS[name][0] % mesh.size:
            print(f"{name}: skipped, {MODELS[name][0]} experts do not split over {mesh.size} devices", flush=True)
            continue
        new = bench_point(name, T, mesh, link, dispatches, args.iterations)
        rows += new
        save_rows(rows, args.json)
        for r in new:
            print(format_row(r), flush=True)
    print("\n" + HEADER + "\n" + "-" * len(HEADER) + "\n" + "\n".join(format_row(r) for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
