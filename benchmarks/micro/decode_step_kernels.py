"""The kernels of one decode step (bench_decode's scan), in launch order: start, gap after the
previous kernel's end, duration and name, from a jax.profiler trace (GPU only). Shows what a
layer launches and where the gaps between launches go:

    python benchmarks/micro/decode_step_kernels.py qwen3 4 8,64   (model, layers, token counts)
"""
import sys

import jax

from jax_moe_permute import bench_decode as bd

name, layers = sys.argv[1], int(sys.argv[2])
model = bd.MODELS[name]._replace(layers=layers)
params = bd.stacked_weights(model, layers)
for T in (int(t) for t in sys.argv[3].split(",")):
    xs = bd.decode_inputs(T, model.hidden)
    compiled = jax.jit(bd.decode_step("ours", model)).lower(xs[0], params).compile()
    jax.block_until_ready(compiled(xs[0], params))
    steps = 3
    device = [(e.start_ns, e.duration_ns, e.name) for plane in bd.traced_planes(compiled, xs[:1], params, steps)
              if plane.name.startswith("/device:GPU")
              for line in ([l for l in plane.lines if l.name.startswith("Stream")] or list(plane.lines))
              for e in line.events]
    parts = bd.split_steps(device, steps)
    if parts is None:
        print(f"T={T}: {len(device)} events do not split into {steps} steps")
        continue
    step, t0 = parts[-1], parts[-1][0][0]
    print(f"\n{name} T={T} {layers} layers: {len(step)} kernels, span {(step[-1][0] + step[-1][1] - t0) / 1e3:.1f} us, "
          f"kernel time {sum(e[1] for e in step) / 1e3:.1f} us")
    end = t0
    for start, duration, kernel in step:
        print(f"{(start - t0) / 1e3:9.2f}  gap {(start - end) / 1e3:6.2f}  {duration / 1e3:7.2f} us  {kernel[:140]}")
        end = start + duration
