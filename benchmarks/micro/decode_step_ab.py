"""The decode step (bench_decode's L-layer scan, ours) under environment settings read when it is
traced or called, one compile per (T, setting) in one process, so that kernel variants can be set
against each other on the same weights (GPU only):

    python benchmarks/micro/decode_step_ab.py MODEL LAYERS TOKENS SETTINGS [UNROLL]
    e.g. qwen3 12 1,8 default,MOE_GROUPED_GEMM_TILE=decode,MOE_GROUPED_GEMM_TILE=decode+JAX_MOE_PERMUTE_DECODE_PDL=0

SETTINGS: comma-separated, each `default` or NAME=VALUE joined by `+`; `residual=0` (not an
environment variable) adds x after moe_mlp instead of as its residual. UNROLL: layers a loop
iteration (0, the default: all of them, one CUDA graph a step, whose span is the device time).
Prints per layer: the wall clock (median of 30 steps over four inputs), the trace's span (first
kernel start to last kernel end) and kernel-time sum, kernels and graphs a step.

    python benchmarks/micro/decode_step_ab.py --host MODEL LAYERS T UNROLL

prints where the host's time of a step goes instead (the trace's host events by total time).

    python benchmarks/micro/decode_step_ab.py --inputs MODEL LAYERS TOKENS UNROLLS

times the step's wall clock (per layer, median of 30 steps) as the inputs arrive: `cycle`, four
different x in turn (the bench's way: a new input buffer every step); `same`, one x every step;
for ours and the stacked form at each unroll (0: all layers, no loop), with the host's time in
XLA's command-buffer events. A CUDA graph whose buffers moved since its last launch is updated on
the host first; the modes tell that cost apart. (Feeding each step its last output instead is no
serving loop without the model's norms: x grows without bound within a few steps.)
Raw output of the runs quoted in BENCHMARKS.md: benchmarks/results/logs/decode-step-ab-h200.txt.
"""
import collections
import os
import sys

import jax

from jax_moe_permute import bench_decode as bd


def settings_of(text):
    return [{} if s == "default" else dict(kv.split("=", 1) for kv in s.split("+")) for s in text.split(",")]


def compiled_step(model, params, x, unroll, residual=True, impl="ours"):
    return jax.jit(bd.decode_step(impl, model, unroll, residual)).lower(x, params).compile()


def per_layer(name, layers, tokens, settings, unroll=0):
    model = bd.MODELS[name]
    params = bd.stacked_weights(model, layers)
    names = {k for s in settings for k in s} - {"residual"}
    for T in tokens:
        xs = bd.decode_inputs(T, model.hidden)
        for setting in settings:
            for k in names:
                os.environ.pop(k, None)
            os.environ.update({k: v for k, v in setting.items() if k != "residual"})
            u = unroll or layers
            c = compiled_step(model, params, xs[0], u, residual=setting.get("residual", "1") != "0")
            wall = bd.wall_us(c, xs, params, steps=30, warmup=5)
            p = bd.profile_or_note(c, xs[0], params, iterations=5)  # (None: no device trace, e.g. on CPU)
            each = lambda key, width: "-".rjust(width) if p[key] is None else f"{p[key] / layers:{width}.1f}"
            print(f"{name} T={T:3d} L={layers} unroll={u:2d} {str(setting):60s} per layer: wall {wall / layers:7.1f} "
                  f"span {each('device_span_us', 7)} ksum {each('device_us', 7)} kernels {each('kernels', 5)} "
                  f"graphs {p['graph_launches']}", flush=True)


def host_events_us(compiled, xs, params, steps=10):
    """The host's trace events over `steps` steps cycling through xs, by name (cut at 70 characters):
    (us a step, events a step). Nested events are counted in their parents too."""
    total, count = collections.Counter(), collections.Counter()
    for plane in bd.traced_planes(compiled, xs, params, steps):
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                for e in line.events:
                    total[e.name[:70]] += e.duration_ns
                    count[e.name[:70]] += 1
    return {name: (ns / 1e3 / steps, count[name] / steps) for name, ns in total.most_common()}


def host_events(name, layers, T, unroll, steps=10):
    model = bd.MODELS[name]
    params = bd.stacked_weights(model, layers)
    xs = bd.decode_inputs(T, model.hidden)
    c = compiled_step(model, params, xs[0], unroll or layers)
    for i in range(5):
        jax.block_until_ready(c(xs[i % len(xs)], params))
    events = host_events_us(c, xs, params, steps)
    print(f"host events {name} T={T} L={layers} unroll={unroll or layers}: us a step (events a step), nested events "
          f"counted in their parents too")
    for event, (us, n) in list(events.items())[:25]:
        print(f"  {us:9.1f} ({n:6.1f})  {event}")


def command_buffer_host_us(compiled, xs, params):
    """Host time a step in XLA's command-buffer events (update: re-recording the commands whose
    buffers moved; execute: the launch)."""
    total = collections.Counter()
    for event, (us, _) in host_events_us(compiled, xs, params).items():
        if event.startswith("command_buffer::"):
            total[event.split("#")[0]] += us
    return total


def input_modes(name, layers, tokens, unrolls, steps=30, warmup=5):
    model = bd.MODELS[name]
    params = bd.stacked_weights(model, layers)
    for T in tokens:
        xs = bd.decode_inputs(T, model.hidden)
        for impl in bd.OURS:
            for unroll in unrolls:
                u = unroll or layers
                c = compiled_step(model, params, xs[0], u, impl=impl)
                for mode, inputs in (("cycle", xs), ("same", xs[:1])):
                    wall = bd.wall_us(c, inputs, params, steps, warmup)
                    host = command_buffer_host_us(c, inputs, params)
                    print(f"{name} T={T:3d} L={layers} {impl:8s} unroll={u:2d} {mode:5s} wall {wall:8.1f} us "
                          f"({wall / layers:6.1f} a layer); host us a step in "
                          + (", ".join(f"{k} {v:.1f}" for k, v in sorted(host.items())) or "no command-buffer events"),
                          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--inputs":
        input_modes(sys.argv[2], int(sys.argv[3]), [int(t) for t in sys.argv[4].split(",")],
                    [int(u) for u in sys.argv[5].split(",")])
    elif sys.argv[1] == "--host":
        host_events(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        per_layer(sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")], settings_of(sys.argv[4]),
                  int(sys.argv[5]) if len(sys.argv) > 5 else 0)
