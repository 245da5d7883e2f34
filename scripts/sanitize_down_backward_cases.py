"""Small cases of the d lhs GEMM with the activation's backward in its epilogue
(cpp/gemm/down_backward.cu) for compute-sanitizer:

    compute-sanitizer --tool memcheck --target-processes application-only python3 scripts/sanitize_down_backward_cases.py

Every activation, bf16 and f16, with and without gates, empty groups, a one-row group, groups
around the 128-row tile, rows past the groups' sum, H not a multiple of 64 (the K tail), F with a
partial 256-column tile; ct's rows in order and read through a row index (tokens -1 and T); each result checked against a float64 reference on the host, so an
uninitialised read also shows as a mismatch. The inputs are copied from the host and the kernel's
own outputs copied back (no XLA kernel touches either), so initcheck restricted to the kernel
(`--kernel-name kns=down_backward_kernel`) sees every write its loads depend on. Arguments (dtype
and activation names, e.g. `bfloat16 swiglu`) run only those cases."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_permute import down_backward, layer
from jax_moe_permute.gather_gemm import ACTIVATION_CODES

CASES = [  # (H, F, group sizes, rows past the sum)
    (72, 320, [0, 1, 130, 0], 3),
    (128, 256, [127, 128, 0, 2], 0),
]


def reference(ct, gate_up, w, w_out, sizes, activation):
    ct, w_out = np.asarray(ct, np.float64), np.asarray(w_out, np.float64)
    g = np.zeros((ct.shape[0], w_out.shape[1]))
    start = 0
    for e, n in enumerate(sizes):
        g[start:start + n] = ct[start:start + n] @ w_out[e].T
        start += n
    gate_up32 = jnp.asarray(np.asarray(gate_up, np.float32))
    h, act_vjp = jax.vjp(lambda a: layer.apply_activation(a, activation), gate_up32)
    h = np.asarray(h, np.float64)
    d_gate_up = np.asarray(act_vjp(jnp.asarray(w * g, jnp.float32))[0], np.float64)
    w_h = np.where(np.arange(len(g))[:, None] < start, w * h, 0.0)
    return d_gate_up, np.sum(g * h, axis=1, keepdims=True), w_h


DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def main(names):
    unknown = [n for n in names if n not in DTYPES and n not in ACTIVATION_CODES]
    if unknown:
        sys.exit(f"unknown argument(s) {unknown}; dtypes {list(DTYPES)}, activations {list(ACTIVATION_CODES)}")
    dtypes = [d for n, d in DTYPES.items() if n in names] or list(DTYPES.values())
    activations = [a for a in ACTIVATION_CODES if a in names] or list(ACTIVATION_CODES)
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]

    def on_device(shape, dtype, scale=1.0):  # written by a host-to-device copy
        return jax.device_put((rng.standard_normal(shape, np.float32) * scale).astype(dtype))

    for dtype in dtypes:
        for activation in activations:
            gated = activation in ("swiglu", "geglu")
            for H, F, sizes, extra in CASES:
                for weighted in (True, False):
                    R = sum(sizes) + extra
                    ct = on_device((R, H), dtype)
                    gate_up = on_device((R, (2 if gated else 1) * F), dtype)
                    w_out = on_device((len(sizes), F, H), dtype, H ** -0.5)
                    w = on_device((R, 1), np.float32) if weighted else jax.device_put(np.zeros((1, 1), np.float32))
                    assert down_backward.kernel_fits(ct, gate_up, w_out, activation), "needs an sm_90 GPU"
                    f = jax.jit(functools.partial(down_backward.kernel_outputs, activation=activation,
                                                  weighted=weighted))
                    device_sizes = jax.device_put(np.asarray(sizes, np.int32))
                    # ct's rows in order, and read through a row index from [T, H] (tokens -1 and T among them)
                    T = R // 2 + 1
                    ct_tokens = on_device((T, H), dtype)
                    tokens = rng.integers(-1, T + 1, R).astype(np.int32)
                    ct_gathered = np.where(((tokens >= 0) & (tokens < T))[:, None],
                                           np.asarray(ct_tokens, np.float64)[np.clip(tokens, 0, T - 1)], 0.0)
                    for ct_in, index, ct_rows in ((ct, None, ct), (ct_tokens, jax.device_put(tokens), ct_gathered)):
                        d_gate_up, d_w_parts, w_h = (np.asarray(a, np.float64) for a in f(
                            ct_in, gate_up, w, w_out, device_sizes, index))
                        with jax.default_device(cpu):
                            want = reference(ct_rows, gate_up, np.asarray(w, np.float64) if weighted else 1.0, w_out,
                                             sizes, activation)
                        for a, b in zip((d_gate_up, d_w_parts.sum(axis=0)[:, None], w_h), want):
                            scale = max(np.abs(b).max(), 1.0)
                            np.testing.assert_allclose(a / scale, b / scale, atol=3e-2)
                        print(f"case {np.dtype(dtype).name} {activation} H={H} F={F} sizes={sizes} "
                              f"weighted={weighted} gathered={index is not None}: ok", flush=True)
    print("CASES DONE")


if __name__ == "__main__":
    main(sys.argv[1:])
