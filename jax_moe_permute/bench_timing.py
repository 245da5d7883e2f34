"""What every benchmark module shares: timing a jitted call (CUPTI kernel time on GPU, wall clock
elsewhere), tolerating out-of-memory shapes, the copy ceilings, and writing rows, tables and
figures.

bench.py, bench_gemm.py, bench_layer.py and bench_decode.py import this module; it imports none
of them.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

SLOW_CALL_S = 1.0  # device_us_or_none times a call this slow once more, not `iterations` times


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def device_us(f: Callable, *args, iterations: int = 20) -> float:
    """Median time of one call of jitted f: CUPTI kernel time on GPU, wall clock elsewhere."""
    if on_gpu():
        from jax.experimental.mosaic.gpu import profiler

        out_bytes = sum(getattr(a, "nbytes", 0) for a in jax.tree.leaves(jax.block_until_ready(f(*args))))
        # CUPTI's measure keeps every iteration's outputs alive (a backward's dW can be 20 GB):
        # batches of iterations whose outputs fit in half the free device memory.
        stats = jax.devices()[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        batch = max(1, min(iterations, int(free / 2 // out_bytes))) if free > 0 and out_bytes else iterations
        times_ms = []
        while len(times_ms) < iterations:
            _, batch_ms = profiler.measure(f, iterations=batch)(*args)
            times_ms += batch_ms if isinstance(batch_ms, (list, tuple)) else [batch_ms]
        return 1e3 * statistics.median(times_ms)
    return wall_us(f, *args, iterations=iterations)


def wall_us(f: Callable, *args, iterations: int = 20) -> float:
    """Median wall clock of one call of f after a warm-up call, each call block_until_ready."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(max(3, iterations)):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def is_out_of_memory(err: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(err)


def none_if_out_of_memory(fn: Callable) -> Callable:
    """Decorator: fn's result, or None (and a note) where XLA runs out of device memory, as the
    pure-JAX ragged_dot's zero-padded expansion can, so one shape does not end a run."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - XLA's runtime error class differs across jax versions
            if not is_out_of_memory(err):
                raise
            print(f"  (out of memory: {str(err).splitlines()[0][:160]})", flush=True)
            return None
    return wrapped


@none_if_out_of_memory
def device_us_or_none(f: Callable, *args, iterations: int = 20) -> float | None:
    """device_us of jitted f, but one more wall-clock call for a call slower than SLOW_CALL_S, and
    None where it runs out of device memory."""
    compiled = f.lower(*args).compile()
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    if time.perf_counter() - start > SLOW_CALL_S:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return 1e6 * (time.perf_counter() - start)
    return device_us(compiled, *args, iterations=iterations)


def sign_flip_copy():
    """A jitted elementwise copy that XLA cannot elide: the sign bits of bf16 pairs flipped as a
    uint32 xor (integer work, so the CPU does not widen bf16 to float32; 32-bit elements, so
    the GPU loads and stores vectors)."""
    return jax.jit(lambda a: a ^ jnp.uint32(0x80008000))


def copy_buffer(nbytes: int) -> jax.Array:
    """The input of a copy that reads and writes `nbytes` in all: nbytes / 8 uint32 elements
    (at least one), random so no page is shared or zero."""
    return jax.random.bits(jax.random.PRNGKey(0), (max(1, nbytes // 8),), jnp.uint32)


@functools.lru_cache(maxsize=None)
def xla_copy_tbps(nbytes: int, iterations: int = 20) -> float:
    """Read+write bandwidth of a jitted elementwise copy moving `nbytes` in all, timed with
    device_us (CUPTI kernel time on GPU, the jitted call's wall clock on CPU)."""
    x = copy_buffer(nbytes)
    us = device_us(sign_flip_copy(), x, iterations=iterations)
    return 8 * x.size / us / 1e6  # 4 bytes read and 4 written per element


def numpy_copy_tbps(nbytes: int) -> float:
    """Read+write bandwidth of numpy's copy between two warm buffers moving `nbytes` in all
    (in cache where they fit), repeated so each timing spans about 4 MB of copies."""
    a = np.arange(max(1, nbytes // 8), dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    repeats = max(1, 2**22 // (2 * a.nbytes))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            np.copyto(b, a)
        times.append((time.perf_counter() - start) / repeats)
    return 2 * a.nbytes / statistics.median(times) / 1e12


@functools.lru_cache(maxsize=None)
def same_bytes_copy_tbps(nbytes: int, iterations: int = 20) -> float:
    """Read+write bandwidth of a warm copy moving `nbytes` in all, its buffers as cache-resident
    as an op's of that size: on GPU a jitted copy timed like the ops (CUPTI kernel time, L2 warm
    from the previous call), on CPU numpy's (no jax dispatch in it)."""
    return xla_copy_tbps(nbytes, iterations) if on_gpu() else numpy_copy_tbps(nbytes)


def op_ceiling_tbps(nbytes: int, large_copy_tbps: float, iterations: int = 20) -> float:
    """The bandwidth an op moving `nbytes` is held to ("% ceil"): the faster of a copy of those
    same bytes (same_bytes_copy_tbps: above device memory's bandwidth where they fit in L2 or
    cache, the reason a 4 GiB copy alone let small ops read over 100%) and the large copy
    (below it where a small copy is launch-bound, or where XLA's copy kernel is slower)."""
    return max(same_bytes_copy_tbps(nbytes, iterations), large_copy_tbps)


def large_copy_buffer_bytes() -> int:
    """The buffer of the large jitted copy: 4 GiB on GPU, far past L2. 16 MiB on CPU, where a
    larger one times page faults on XLA's fresh output more than the copy (CPU numbers are a
    smoke test, not a goal)."""
    return 2**32 if on_gpu() else 2**24


def jitted_copy_tbps(buffer_bytes: int | None = None, iterations: int = 20) -> float:
    """Read+write bandwidth of a jitted elementwise copy of a large buffer (what XLA's own
    kernels reach; the bound the decode issue quotes), timed with device_us."""
    return xla_copy_tbps(2 * (buffer_bytes or large_copy_buffer_bytes()), iterations)


def copy_ceiling_tbps(nbytes: int = 2**32) -> float:
    """Read+write bandwidth of a large copy of an `nbytes` buffer: device-to-device (torch's
    copy_ when available and it has the memory) on GPU, between two warm 128 MiB numpy buffers
    on CPU."""
    if on_gpu():
        try:
            import torch

            a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                start.record()
                b.copy_(a)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            del a, b
            torch.cuda.empty_cache()
            return 2 * nbytes / statistics.median(times) / 1e12
        except ImportError:
            pass
        except RuntimeError as err:  # torch out of memory: jax may hold most of the device already
            if "out of memory" not in str(err):
                raise
            torch.cuda.empty_cache()
        return jitted_copy_tbps(nbytes)
    # CPU: a copy between two warm buffers (XLA's fresh outputs would add page faults).
    a = np.arange(2**25, dtype=np.float32)  # 128 MiB, every page written
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / statistics.median(times) / 1e12


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing."""
    return None if a is None or b is None else a / b


def cell(x, spec: str, missing: str = "-") -> str:
    """A table cell: x formatted, or `missing` right-aligned to the spec's width."""
    return format(x, spec) if x is not None else missing.rjust(int(re.match(r"\d*", spec).group() or 0))


def text_table(header: str, lines) -> str:
    """The header, a rule under it and the rows' lines."""
    return "\n".join([header, "-" * len(header), *lines])


def figure(nrows: int, ncols: int, width: float, height: float):
    """A matplotlib figure for a file (the Agg backend) and its nrows x ncols axes, each width x height
    inches (matplotlib is imported only here: the benchmarks run without it unless asked to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_rows(rows, path: str) -> None:
    """Writes the rows as JSON; called after every shape, so an interrupted run keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def progress(items):
    """tqdm's bar when it is installed, else one `[i/n]` line per item on stderr."""
    try:
        from tqdm import tqdm

        return tqdm(items, file=sys.stderr)
    except ImportError:
        def counted():
            for i, item in enumerate(items, 1):
                print(f"[{i}/{len(items)}] {item}", file=sys.stderr, flush=True)
                yield item
        return counted()
