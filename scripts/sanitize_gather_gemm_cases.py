"""Small cases of the fused gather + grouped GEMM + activation (cpp/gemm/gather_gemm.cu) for
compute-sanitizer:

    compute-sanitizer --tool memcheck --target-processes application-only python3 scripts/sanitize_gather_gemm_cases.py

Every activation the kernel takes, bf16 and f16, the pre-activation output on and off, tokens -1
and past T, empty groups, a one-row group, groups around the 128-row tile, rows past the groups'
sum, H not a multiple of 64 (the K tail); each result checked against a float64 NumPy reference
on the host, so an uninitialised read also shows as a mismatch."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_permute import gather_gemm
from jax_moe_permute.grouped_gemm import kernels_available

CASES = [  # (T, H, F, group sizes, rows past the sum)
    (5, 72, 128, [0, 1, 130, 0], 3),
    (40, 128, 256, [127, 128, 0, 2], 0),
]


def reference(x, row_token, sizes, w, activation, gated):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    pre = np.zeros((len(row_token), w.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        for r in range(start, start + n):
            if 0 <= row_token[r] < x.shape[0]:
                pre[r] = x[row_token[r]] @ w[g]
        start += n
    act = {"swiglu": jax.nn.silu, "geglu": lambda v: jax.nn.gelu(v, approximate=False),
           "gelu": lambda v: jax.nn.gelu(v, approximate=False), "relu": jax.nn.relu,
           "none": lambda v: v}[activation]
    if gated:
        gate, up = np.split(pre, 2, axis=1)
        return np.asarray(act(gate), np.float64) * up, pre
    return np.asarray(act(pre), np.float64), pre


def main():
    assert kernels_available(), "needs an sm_90 GPU and the CUDA module"
    key = jax.random.PRNGKey(0)
    for dtype in (jnp.bfloat16, jnp.float16):
        for activation, code in gather_gemm.ACTIVATION_CODES.items():
            gated = activation in ("swiglu", "geglu")
            for T, H, F, sizes, extra in CASES:
                k1, k2, k3, key = jax.random.split(key, 4)
                M = sum(sizes) + extra
                x = jax.random.normal(k1, (T, H)).astype(dtype)
                w = (jax.random.normal(k2, (len(sizes), H, (2 if gated else 1) * F)) * H ** -0.5).astype(dtype)
                tokens = np.array(jax.random.randint(k3, (M,), 0, T))
                tokens[0], tokens[-1] = -1, T  # no input
                if not gather_gemm.kernel_fits(x, w, M, activation):
                    print(f"skipped {activation}: the kernel does not take it")
                    continue
                for save_pre in (False, True):
                    f = jax.jit(lambda *a: gather_gemm.gather_gemm(*a, activation=activation, save_pre=save_pre))
                    args = (x, jnp.asarray(tokens, jnp.int32), jnp.asarray(sizes, jnp.int32), w)
                    assert "jax_moe_permute.gather_gemm" in f.lower(*args).as_text()
                    out, pre = f(*args)
                    want, want_pre = reference(x, tokens, sizes, w, activation, gated)
                    tol = 3e-2 * max(1.0, float(np.abs(want_pre).max()))
                    assert np.abs(np.asarray(out, np.float64) - want).max() <= tol, (dtype, activation, T, H, F)
                    if save_pre:
                        assert np.abs(np.asarray(pre, np.float64) - want_pre).max() <= tol
    print("SANITIZE GATHER GEMM CASES DONE")


if __name__ == "__main__":
    main()
