"""Small cases of the d lhs GEMM with the activation's backward in its epilogue
(cpp/gemm/down_backward.cu) for compute-sanitizer:

    compute-sanitizer --tool memcheck --target-processes application-only python3 scripts/sanitize_down_backward_cases.py

Every activation, bf16 and f16, with and without gates, empty groups, a one-row group, groups
around the 128-row tile, rows past the groups' sum, H not a multiple of 64 (the K tail), F with a
partial 256-column tile; each result checked against a float64 NumPy reference on the host, so an
uninitialised read also shows as a mismatch. Arguments (dtype and activation names, e.g.
`bfloat16 swiglu`) run only those cases: the whole set takes minutes under initcheck."""

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
    key = jax.random.PRNGKey(0)
    for dtype in dtypes:
        for activation in activations:
            gated = activation in ("swiglu", "geglu")
            for H, F, sizes, extra in CASES:
                for weighted in (True, False):
                    k1, k2, k3, k4, key = jax.random.split(key, 5)
                    R = sum(sizes) + extra
                    ct = jax.random.normal(k1, (R, H)).astype(dtype)
                    gate_up = jax.random.normal(k2, (R, (2 if gated else 1) * F)).astype(dtype)
                    w_out = (jax.random.normal(k3, (len(sizes), F, H)) * H ** -0.5).astype(dtype)
                    w = jax.random.normal(k4, (R, 1)) if weighted else jnp.zeros((1, 1))
                    assert down_backward.kernel_fits(ct, gate_up, w_out, activation), "needs an sm_90 GPU"
                    f = jax.jit(lambda *a: down_backward.down_vjp_p.bind(*a, activation=activation, weighted=weighted))
                    got = f(ct, gate_up, w, w_out, jnp.asarray(sizes, jnp.int32))
                    want = reference(ct, gate_up, np.asarray(w, np.float64) if weighted else 1.0, w_out, sizes,
                                     activation)
                    for a, b in zip(got, want):
                        scale = max(np.abs(b).max(), 1.0)
                        np.testing.assert_allclose(np.asarray(a, np.float64) / scale, b / scale, atol=3e-2)
    print("CASES DONE")


if __name__ == "__main__":
    main(sys.argv[1:])
