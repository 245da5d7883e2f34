"""Decode benchmark: one serving decode step of an L-layer stack of MoE blocks, ours against the
same stack in pure JAX, and against the time to read the weights it routes to.

    python -m jax_moe_permute.bench --ops decode [--model qwen3,mixtral,deepseek] [--tokens 1,8,64]
        [--layers N] [--steps 50] [--quick] [--no-reference] [--json out.json] [--plot out.png]

The step is one `jax.jit` of a `lax.scan` over stacked per-layer weights (router [L, H, E],
w_in [L, E, H, 2F], w_out [L, E, F, H], bf16; DeepSeek-V3 also a selection bias [L, E]), each
layer `x = moe_mlp(x, r.weights, r.ids, w_in, w_out, residual=x)` (the block's residual add, which
the fused decode kernels make in their last launch) with `r = route_tokens(x, router, K, ...)`
(`route(router_logits(x, router), K, ...)`, one launch at decode sizes on sm_90) and the model's
routing (MODELS). The pure-JAX stack is the same scan with
`layer.reference_moe_mlp` (argsort + take, jax.lax.ragged_dot, gather + weighted sum). The
"stacked" row is ours written the other way: a scan over the layer index that passes the stacks
whole (`route_tokens(..., layer=i)`, `moe_mlp(..., layer=i)`), so that the decode kernels read
the layer on the device instead of receiving XLA's dynamic slice of the stack (whose offset XLA
copies to the host and waits for, per custom call and layer).

wall_us: median wall clock of a step (each `block_until_ready`) over --steps steps after
--warmup, cycling through N_INPUTS different x. On GPU a jax.profiler trace of a few steps
(CUPTI's records; trace_profile) gives device_us, the step's kernel times summed, device_span_us,
its first kernel's start to its last kernel's end, and what the host launched: kernels one by one
(host_launches) and CUDA graphs (graph_launches: XLA's command buffers); on CPU device_us is the
wall clock again. None where the profiler fails.
bound_bytes: the expert weights the step must read, the distinct experts each layer routes to
(from ours' routing of the same inputs, mean over them) times 3*H*F*2 bytes, summed over the
layers, plus the routers' bytes; bound_us reads them at the run's large-copy ceiling
(bench_timing.copy_ceiling_tbps), jit_bound_us at a large jitted elementwise copy's bandwidth
(bench_timing.jitted_copy_tbps: what XLA's own kernels reach). speedup: pure JAX's time over
ours. temp_bytes etc.: `compiled.memory_analysis()`, the memory the step needs beyond its
arguments (the weights). custom_calls, command_buffers, loop_in_command_buffer, body_thunks:
read off the compiled step's optimized HLO (`compiled.as_text()`; hlo_stats); the trace's
launch counts say what XLA did at run time, whatever the HLO shows.

DeepSeek-V3 runs as many layers as fit in the device's free memory with headroom (printed);
Mixtral's 32 layers are about 90 GB, Qwen3's 48 about 58 GB. The weights are drawn on the
device in bf16 and freed between models. A pure-JAX step that runs out of memory is recorded as
None ("OOM"). On CPU the default model is "tiny" ("tiny_grouped": DeepSeek-V3's routing).
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import statistics
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import layer
from .bench_timing import (cell, copy_ceiling_tbps, device_us, figure, jitted_copy_tbps, none_if_out_of_memory,
                           on_gpu, progress, ratio, save_figure, save_rows, text_table)
from .routing import route_tokens

OPS = ("decode",)
IMPLS = ("ours", "stacked", "pure_jax")
OURS = ("ours", "stacked")  # the scan slicing the stacks / passing them whole with the layer index
TOKENS = (1, 8, 64)
QUICK_TOKENS = (1, 64)
N_INPUTS = 4  # different x the timed steps cycle through
SOFTMAX = dict(scoring="softmax", renormalize=True)
DEEPSEEK_ROUTING = dict(scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4, routed_scaling_factor=2.5)
HEADROOM_FRACTION = 0.1  # of the device's memory left free when fitting layers (the pure-JAX step's temporaries)
MIN_HEADROOM_BYTES = 8 * 2**30


class DecodeModel(NamedTuple):
    experts: int
    top_k: int
    hidden: int
    ffn: int
    layers: int | None  # None: as many as fit in device memory
    routing: dict  # route()'s keyword arguments
    bias: bool = False  # a per-layer selection bias [E] (DeepSeek-V3's e_score_correction_bias)


MODELS = {
    "qwen3": DecodeModel(128, 8, 2048, 768, 48, SOFTMAX),  # Qwen3-30B-A3B
    "mixtral": DecodeModel(8, 2, 4096, 14336, 32, SOFTMAX),  # Mixtral 8x7B
    "deepseek": DecodeModel(256, 8, 7168, 2048, None, DEEPSEEK_ROUTING, bias=True),  # DeepSeek-V3
    "tiny": DecodeModel(8, 2, 64, 96, 3, SOFTMAX),  # CPU / CI
    "tiny_grouped": DecodeModel(16, 4, 64, 32, 2, dict(DEEPSEEK_ROUTING, num_groups=4, topk_groups=2), bias=True),
}
GPU_MODELS = ("qwen3", "mixtral", "deepseek")


def expert_bytes(model: DecodeModel, itemsize: int = 2) -> int:
    """One expert's w_in [H, 2F] and w_out [F, H]."""
    return 3 * model.hidden * model.ffn * itemsize


def router_bytes(model: DecodeModel, itemsize: int = 2) -> int:
    """One layer's router [H, E] (and float32 bias [E])."""
    return model.hidden * model.experts * itemsize + (4 * model.experts if model.bias else 0)


def layer_bytes(model: DecodeModel, itemsize: int = 2) -> int:
    return model.experts * expert_bytes(model, itemsize) + router_bytes(model, itemsize)


def layers_that_fit(model: DecodeModel, memory_stats: dict | None) -> int | None:
    """Layers whose weights fit in the free device memory less the headroom; None without
    memory statistics (CPU)."""
    if not memory_stats or "bytes_limit" not in memory_stats:
        return None
    limit = memory_stats["bytes_limit"]
    free = limit - memory_stats.get("bytes_in_use", 0)
    headroom = max(MIN_HEADROOM_BYTES, HEADROOM_FRACTION * limit)
    return max(0, int((free - headroom) // layer_bytes(model)))


def random_stack(key, count: int, shape: tuple, scale: float, dtype) -> jax.Array:
    """[count, *shape] random normal * scale in dtype, drawn a block of at most 2^26 elements at
    a time (traced: call it under jit): small temporaries, and each draw well under the 2^32
    elements of one PRNG counter. The block divides count: lax.map would concatenate a
    remainder, a copy of the whole stack."""
    most = max(1, min(count, 2**26 // math.prod(shape)))
    batch = max(d for d in range(1, most + 1) if count % d == 0)
    draw = lambda k: (jax.random.normal(k, shape, dtype) * scale).astype(dtype)
    return jax.lax.map(draw, jax.random.split(key, count), batch_size=batch)


def stacked_weights(model: DecodeModel, layers: int, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """router [L, H, E], w_in [L, E, H, 2F], w_out [L, E, F, H] in dtype, scaled by fan-in (and
    bias [L, E] float32 for a biased router), drawn on the device in one jit."""
    E, H, F = model.experts, model.hidden, model.ffn

    @jax.jit
    def draw(key):
        k = jax.random.split(key, 4)
        # expert by expert; the reshapes inside the jit are free (no copy of 90 GB)
        params = dict(router=random_stack(k[0], layers, (H, E), H ** -0.5, dtype),
                      w_in=random_stack(k[1], layers * E, (H, 2 * F), H ** -0.5, dtype).reshape(layers, E, H, 2 * F),
                      w_out=random_stack(k[2], layers * E, (F, H), F ** -0.5, dtype).reshape(layers, E, F, H))
        if model.bias:
            params["bias"] = 0.01 * jax.random.normal(k[3], (layers, E), jnp.float32)
        return params

    return draw(jax.random.PRNGKey(seed))


def decode_inputs(T: int, H: int, dtype=jnp.bfloat16, seed: int = 100) -> list:
    """N_INPUTS different [T, H] token batches."""
    return [jax.random.normal(jax.random.PRNGKey(seed + i), (T, H), jnp.float32).astype(dtype)
            for i in range(N_INPUTS)]


def moe_block(impl: str, model: DecodeModel, residual: bool = True):
    """f(x [T, H], one layer's params) -> (x + the routed experts' output, ids [T, K]); ours adds x
    as moe_mlp's residual (`residual=False`: after the call, as its own XLA add)."""
    def block(x, p):
        r = route_tokens(x, p["router"], model.top_k, bias=p.get("bias"), **model.routing)
        args = (x, r.weights, r.ids, p["w_in"], p["w_out"])
        if impl == "ours" and residual:
            return layer.moe_mlp(*args, residual=x), r.ids
        return x + (layer.moe_mlp if impl == "ours" else layer.reference_moe_mlp)(*args), r.ids

    return block


def decode_step(impl: str, model: DecodeModel, unroll: int = 1, residual: bool = True):
    """step(x [T, H], stacked params) -> x after every layer: one scan over the layers
    (`unroll` layers per loop iteration; the layer count: no loop). "ours" and "pure_jax" scan
    over the stacks (XLA slices a layer's weights out of them); "stacked" scans over the layer
    index and passes the stacks whole (route_tokens(..., layer=i), moe_mlp(..., layer=i)).
    `residual` as in moe_block."""
    if impl == "stacked":
        def body(x, i, params):
            r = route_tokens(x, params["router"], model.top_k, bias=params.get("bias"), layer=i, **model.routing)
            y = layer.moe_mlp(x, r.weights, r.ids, params["w_in"], params["w_out"], layer=i,
                              residual=x if residual else None)
            return (y if residual else x + y), None

        def step(x, params):
            layers = jnp.arange(params["router"].shape[0], dtype=jnp.int32)
            return jax.lax.scan(lambda x, i: body(x, i, params), x, layers, unroll=unroll)[0]
        return step
    block = moe_block(impl, model, residual)
    return lambda x, params: jax.lax.scan(lambda x, p: (block(x, p)[0], None), x, params, unroll=unroll)[0]


def routed_experts(model: DecodeModel, params: dict, xs) -> list[list[int]]:
    """For each x of xs, the distinct experts each layer of ours routes it to (the experts whose
    weights the step reads): [input][layer]. Layer by layer, one layer's weights sliced out at a
    time: a scan over the stacks that returns the ids made XLA copy Mixtral's whole w_in (56 GiB
    on the H200, out of memory)."""
    block = jax.jit(moe_block("ours", model))
    xs, counts = list(xs), [[] for _ in xs]
    for i in range(params["router"].shape[0]):
        p = jax.tree.map(lambda a: a[i], params)
        for j, x in enumerate(xs):
            xs[j], ids = block(x, p)
            counts[j].append(int(np.unique(np.asarray(ids)).size))
    return counts


def wall_us(compiled, xs, params, steps: int, warmup: int) -> float:
    """Median wall clock of one step, each step blocked on, cycling through the inputs xs."""
    for i in range(warmup):
        jax.block_until_ready(compiled(xs[i % len(xs)], params))
    times = []
    for i in range(max(1, steps)):
        x = xs[i % len(xs)]
        start = time.perf_counter()
        jax.block_until_ready(compiled(x, params))
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def compiled_memory(compiled) -> dict:
    """The compiled step's memory beyond its arguments, from memory_analysis() (None where the
    backend gives none)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        m = None
    keys = ("temp_bytes", "output_bytes", "alias_bytes", "argument_bytes", "code_bytes", "extra_bytes")
    if m is None:
        return dict.fromkeys(keys)
    extra = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return dict(zip(keys, (m.temp_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                           m.argument_size_in_bytes, m.generated_code_size_in_bytes, extra)))


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
NOT_THUNKS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}  # no kernel, no thunk


def hlo_computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from an HLO module's text."""
    computations, name = {}, None
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            name = match.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and "=" in line:
            computations[name].append(line)
    return computations


def opcode(instruction: str) -> str | None:
    match = _OPCODE.search(instruction.split("=", 1)[1])
    return match.group(1) if match else None


def hlo_stats(text: str) -> dict:
    """What the compiled step's optimized HLO says about launches: custom-calls in the module
    (our kernels, and cuBLAS GEMMs on GPU), XLA command buffers (computations `command_buffer*`,
    each replayed as one CUDA graph), whether the layer loop itself runs inside one, and the
    instructions of the loop body that become thunks (all but parameter, constant, tuple,
    get-tuple-element and bitcast; a command buffer counts once): a proxy of the thunks a layer
    runs."""
    computations = hlo_computations(text)
    command_buffers = [n for n in computations if n.startswith("command_buffer")]
    bodies = [m for m in re.findall(r"\bbody=%?([\w.\-]+)", text) if m in computations]
    body = max(bodies, key=lambda n: len(computations[n]), default=None)  # the scan over the layers
    body_ops = [opcode(i) for i in computations.get(body, [])]
    loop_in_command_buffer = any(opcode(i) == "while" for n in command_buffers for i in computations[n])
    body_calls = sum(1 for i in computations.get(body, []) if re.search(r"to_apply=%?command_buffer", i))
    return dict(custom_calls=sum(opcode(i) == "custom-call" for lines in computations.values() for i in lines),
                command_buffers=len(command_buffers), loop_in_command_buffer=loop_in_command_buffer,
                body_thunks=sum(1 for op in body_ops if op and op not in NOT_THUNKS) if body else None,
                body_command_buffer_calls=body_calls if body else None)


GRAPH_LAUNCH = re.compile(r"graph", re.IGNORECASE)  # the host's CUDA graph launches (cuGraphLaunch)


def split_steps(events, steps: int) -> list[list[tuple]] | None:
    """Device events (start_ns, duration_ns, name) of `steps` steps, each step blocked on, split
    at the steps - 1 widest gaps between one event's end and the next's start; None where the
    steps do not hold the same number of events."""
    events = sorted(events)
    if steps < 1 or len(events) < steps:
        return None
    gaps = [events[i + 1][0] - (events[i][0] + events[i][1]) for i in range(len(events) - 1)]
    cuts = sorted(sorted(range(len(gaps)), key=lambda i: gaps[i])[len(gaps) - steps + 1:]) if steps > 1 else []
    bounds = [0] + [i + 1 for i in cuts] + [len(events)]
    parts = [events[a:b] for a, b in zip(bounds, bounds[1:])]
    return parts if len({len(p) for p in parts}) == 1 else None


def traced_planes(compiled, xs, params, steps: int) -> list:
    """The jax.profiler trace's planes (CUPTI's device records, the host's events) of `steps` steps,
    each blocked on, cycling through the inputs xs."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for i in range(steps):
                jax.block_until_ready(compiled(xs[i % len(xs)], params))
        return [plane for path in glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
                for plane in ProfileData.from_file(path).planes]


def trace_profile(compiled, x, params, steps: int = 5) -> dict:
    """One step as a jax.profiler trace (CUPTI's records) of `steps` steps shows it: device_us, the
    kernels' time summed (CUPTI device time; overlapping kernels count twice); device_span_us,
    first kernel start to last kernel end (what overlap and programmatic dependent launches
    save); kernels, the device's kernels and copies; host_launches, those the host launched one
    by one (its launch events carry the kernel's name); graph_launches, CUDA graphs launched
    (XLA's command buffers replayed). Medians over the steps, per step."""
    jax.block_until_ready(compiled(x, params))
    planes = traced_planes(compiled, [x], params, steps)
    device, host = [], collections.Counter()
    for plane in planes:
        if plane.name.startswith("/device:GPU"):
            lines = [line for line in plane.lines if line.name.startswith("Stream")] or list(plane.lines)
            device += [(e.start_ns, e.duration_ns, e.name) for line in lines for e in line.events]
        elif plane.name.startswith("/host:"):
            host.update(e.name for line in plane.lines for e in line.events)
    parts = split_steps(device, steps)
    if parts is None:
        raise RuntimeError(f"the trace's {len(device)} device events do not split into {steps} equal steps")
    names = {name for _, _, name in device}
    return dict(device_us=statistics.median(sum(e[1] for e in p) for p in parts) / 1e3,
                device_span_us=statistics.median(p[-1][0] + p[-1][1] - p[0][0] for p in parts) / 1e3,
                kernels=len(parts[0]),
                host_launches=sum(n for name, n in host.items() if name in names) / steps,
                graph_launches=sum(n for name, n in host.items() if GRAPH_LAUNCH.search(name)) / steps)


PROFILE_KEYS = ("device_us", "device_span_us", "kernels", "host_launches", "graph_launches")


def profile_or_note(compiled, x, params, iterations: int) -> dict:
    """trace_profile on GPU, device_us (wall clock) elsewhere; Nones (and a note) where the
    profiler fails: its numbers are extra, and the wall clock already has the step's time."""
    try:
        if on_gpu():
            return trace_profile(compiled, x, params, steps=max(2, min(iterations, 10)))
        return dict(dict.fromkeys(PROFILE_KEYS), device_us=device_us(compiled, x, params, iterations=iterations))
    except Exception as err:  # noqa: BLE001 - the profiler's and XLA's errors alike; the run goes on
        print(f"  (device time not measured: {type(err).__name__}: {str(err).splitlines()[0][:160]})", flush=True)
        return dict.fromkeys(PROFILE_KEYS)


@none_if_out_of_memory
def measure(impl: str, model: DecodeModel, params: dict, xs, steps: int, warmup: int, iterations: int,
            unroll: int = 1) -> dict:
    """Times, memory and HLO statistics of one implementation's step; None out of memory."""
    compiled = jax.jit(decode_step(impl, model, unroll)).lower(xs[0], params).compile()
    out = dict(compiled_memory(compiled), **hlo_stats(compiled.as_text()))
    out["wall_us"] = wall_us(compiled, xs, params, steps, warmup)
    out.update(profile_or_note(compiled, xs[0], params, iterations))
    return out


def bench_point(name: str, params: dict, T: int, copy_tbps: float, jit_tbps: float, steps: int = 50,
                warmup: int = 5, iterations: int = 20, with_reference: bool = True, unroll: int = 1) -> list[dict]:
    """One row per implementation of MODELS[name]'s decode step at T tokens."""
    model = MODELS[name]
    L = params["router"].shape[0]
    xs = decode_inputs(T, model.hidden)
    routed = routed_experts(model, params, xs)
    per_layer = float(np.mean([np.mean(r) for r in routed]))
    nbytes = float(np.mean([sum(r) for r in routed])) * expert_bytes(model) + L * router_bytes(model)
    bound_us, jit_bound_us = nbytes / copy_tbps / 1e6, nbytes / jit_tbps / 1e6
    times = {}
    for impl in IMPLS:
        if impl in OURS or with_reference:
            times[impl] = measure(impl, model, params, xs, steps, warmup, iterations, unroll)
    rows = []
    for impl in IMPLS:
        got = times.get(impl)
        status = "ok" if got else ("OOM" if impl in times else "skipped")
        got = got or {}
        wall, dev = got.get("wall_us"), got.get("device_us")
        mine, theirs = times.get(impl) or {}, times.get("pure_jax") or {}
        rows.append(dict(
            model=name, T=T, impl=impl, status=status, layers=L, unroll=unroll, E=model.experts, K=model.top_k,
            H=model.hidden,
            F=model.ffn, routing=dict(model.routing, bias=model.bias), wall_us=wall, device_us=dev,
            routed_experts_per_layer=per_layer, bound_bytes=nbytes, copy_TBps=copy_tbps, jit_copy_TBps=jit_tbps,
            bound_us=bound_us, jit_bound_us=jit_bound_us, wall_over_bound=ratio(wall, bound_us),
            device_over_bound=ratio(dev, bound_us), wall_over_jit_bound=ratio(wall, jit_bound_us),
            device_over_jit_bound=ratio(dev, jit_bound_us),
            speedup_wall=ratio(theirs.get("wall_us"), mine.get("wall_us")) if impl in OURS else None,
            speedup_device=ratio(theirs.get("device_us"), mine.get("device_us")) if impl in OURS else None,
            **{k: got.get(k) for k in ("temp_bytes", "output_bytes", "alias_bytes", "argument_bytes", "code_bytes",
                                       "extra_bytes", "custom_calls", "command_buffers", "loop_in_command_buffer",
                                       "body_thunks", "body_command_buffer_calls", "device_span_us", "kernels",
                                       "host_launches", "graph_launches")}))
    return rows


HEADER = (f"{'model':12} {'T':>4} {'impl':8} {'L':>3} {'wall us':>10} {'dev us':>10} {'bound us':>9} "
          f"{'wall/bnd':>8} {'dev/bnd':>7} {'wall/jbnd':>9} {'dev/jbnd':>8} {'x JAX':>6} {'x JAX dev':>9} "
          f"{'temp MiB':>8} {'ccalls':>6} {'body':>5} {'cmdbuf':>6} {'loop cb':>7} {'span us':>9} {'kernels':>7} "
          f"{'host lnch':>9} {'graphs':>6}")


def format_row(r) -> str:
    missing = {"ok": "-", "OOM": "OOM", "skipped": "skipped"}[r["status"]]
    temp = None if r["temp_bytes"] is None else r["temp_bytes"] / 2**20
    loop_cb = "-" if r["loop_in_command_buffer"] is None else ("yes" if r["loop_in_command_buffer"] else "no")
    return (f"{r['model']:12} {r['T']:>4} {r['impl']:8} {r['layers']:>3} {cell(r['wall_us'], '10.1f', missing)} "
            f"{cell(r['device_us'], '10.1f', missing)} {r['bound_us']:9.1f} "
            f"{cell(r['wall_over_bound'], '8.2f')} {cell(r['device_over_bound'], '7.2f')} "
            f"{cell(r['wall_over_jit_bound'], '9.2f')} {cell(r['device_over_jit_bound'], '8.2f')} "
            f"{cell(r['speedup_wall'], '6.2f')} {cell(r['speedup_device'], '9.2f')} {cell(temp, '8.1f')} "
            f"{cell(r['custom_calls'], '6d')} {cell(r['body_thunks'], '5d')} {cell(r['command_buffers'], '6d')} "
            f"{loop_cb:>7} {cell(r['device_span_us'], '9.1f')} {cell(r['kernels'], '7d')} "
            f"{cell(r['host_launches'], '9.0f')} {cell(r['graph_launches'], '6.0f')}")


def format_table(rows) -> str:
    return text_table(HEADER, map(format_row, rows))


def plot(rows, path: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = figure(2, len(models), 5, 4)
    for col, model in enumerate(models):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["T"])
        ax = axes[0][col]
        for impl, style in (("ours", dict(marker="o")), ("stacked", dict(marker="s")),
                            ("pure_jax", dict(marker="x", ls="--"))):
            for key, label, extra in (("wall_us", "wall", {}), ("device_us", "device", dict(alpha=0.6))):
                pts = [(r["T"], r[key] / 1e3) for r in mine if r["impl"] == impl and r[key] is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{impl} {label}", **style, **extra)
        bound = [r for r in mine if r["impl"] == "ours"]
        ax.plot([r["T"] for r in bound], [r["bound_us"] / 1e3 for r in bound], color="k", label="weight-read bound")
        ax.plot([r["T"] for r in bound], [r["jit_bound_us"] / 1e3 for r in bound], color="k", ls=":",
                label="bound at jitted copy")
        layers = mine[0]["layers"] if mine else 0
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="ms per decode step",
               title=f"{model} ({layers} layers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        for impl, marker in (("ours", "o"), ("stacked", "s"), ("pure_jax", "x")):
            for key, label, ls in (("wall_over_bound", "wall", "-"), ("device_over_bound", "device", ":")):
                pts = [(r["T"], r[key]) for r in mine if r["impl"] == impl and r[key] is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ls=ls, label=f"{impl} {label}")
        ax.axhline(1.0, color="k", lw=1)
        ax.axhline(1.5, color="k", lw=1, ls="--", label="1.5x (goal)")
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="time / weight-read bound")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def free(params: dict) -> None:
    """Deletes the weights now (a model's stack can be 90 GB), not when Python gets round to it."""
    for a in jax.tree.leaves(params):
        a.delete()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="decode")
    p.add_argument("--model", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--tokens", default="", help="comma-separated token counts (default 1,8,64)")
    p.add_argument("--layers", type=int, default=0, help="layers of every model (default: the model's)")
    p.add_argument("--steps", type=int, default=50, help="timed wall-clock steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--iterations", type=int, default=20, help="CUPTI iterations")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 20 steps")
    p.add_argument("--no-reference", action="store_true", help="skip the pure-JAX stack")
    p.add_argument("--unroll", type=int, default=1,
                   help="layers per loop iteration of the scan (0: all of them, no loop); default 1")
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--plot", default="", help="write a PNG plot here")
    args = p.parse_args(argv)
    if args.ops.split(",") != list(OPS):
        p.error(f"the decode benchmark runs {', '.join(OPS)} alone; got {args.ops}")
    names = (args.model or ",".join(GPU_MODELS if on_gpu() else ("tiny",))).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    steps = min(args.steps, 20) if args.quick else args.steps

    copy_tbps, jit_tbps = copy_ceiling_tbps(), jitted_copy_tbps()
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); large copy {copy_tbps:.3g} TB/s, "
          f"jitted elementwise copy {jit_tbps:.3g} TB/s", flush=True)
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    for name in names:
        model = MODELS[name]
        L = args.layers or model.layers
        if not L:
            L = layers_that_fit(model, jax.devices()[0].memory_stats())
            if L is None:
                L = 1
                print(f"{name}: no device memory statistics, 1 layer (--layers to choose)", flush=True)
            else:
                print(f"{name}: {L} layers fit in the free device memory ({layer_bytes(model) / 2**30:.1f} GiB "
                      f"a layer, headroom {HEADROOM_FRACTION:.0%} of the device, at least "
                      f"{MIN_HEADROOM_BYTES / 2**30:.0f} GiB)", flush=True)
            if L == 0:
                print(f"{name}: skipped, not one layer fits", flush=True)
                continue
        print(f"{name}: {L} layers, {L * layer_bytes(model) / 1e9:.1f} GB of weights", flush=True)
        params = stacked_weights(model, L)
        for T in progress(tokens):
            new = bench_point(name, params, T, copy_tbps, jit_tbps, steps=steps, warmup=args.warmup,
                              iterations=args.iterations, with_reference=not args.no_reference,
                              unroll=args.unroll or L)
            rows += new
            save_rows(rows, args.json)
            for r in new:  # as measured, so a run cut short still shows its rows
                print(format_row(r), flush=True)
        free(params)
    print("\n" + format_table(rows))
    if any(r["status"] == "OOM" for r in rows):
        print("OOM: that step ran out of device memory (the pure-JAX ragged_dot's zero-padded expansion)")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
