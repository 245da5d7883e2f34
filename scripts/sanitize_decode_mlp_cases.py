"""Small cases of the fused decode MLP (cpp/gemm/moe_mlp_decode.cu) for compute-sanitizer:

    compute-sanitizer --tool memcheck --target-processes application-only python3 scripts/sanitize_decode_mlp_cases.py

Both forms of the kernels (JAX_MOE_PERMUTE_DECODE_MLP=split, slices), every activation, bf16 and
f16, ids past the experts, -1 and repeated, several splits of H and F, a strip past the last
column, more output strips than a block's warps and a partial slice of F, many pairs per expert
(the kernels forced), and the stacked form
(weights stacked over 3 layers, the layer read on the device: the last one as 2, as -1 and as 7,
which clamps), with the block's residual added; each result checked against a float64 NumPy reference on the host, so an
uninitialised read also shows as a mismatch."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp
from jax_moe_permute import decode_mlp
from jax_moe_permute.grouped_gemm import kernels_available

CASES = [  # (T, E, K, H, F)
    (1, 16, 4, 264, 40),   # H and 2F not multiples of 256
    (2, 8, 2, 1024, 520),  # split H and F
    (5, 3, 2, 64, 16),     # more pairs than experts
    (1, 8, 2, 2056, 136),  # 9 output strips, a partial slice of F
]
FORMS = ("split", "slices")


def reference(x, w, ids, w_in, w_out, activation):
    x, w_in, w_out = (np.asarray(a, np.float64) for a in (x, w_in, w_out))
    out = np.zeros((x.shape[0], w_out.shape[2]))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w_in.shape[0]:
                continue
            h = x[t] @ w_in[e]
            if activation in ("swiglu", "geglu"):
                g, u = np.split(h, 2)
                a = np.asarray(jax.nn.silu(g) if activation == "swiglu" else jax.nn.gelu(g, approximate=False)) * u
            else:
                a = np.maximum(h, 0) if activation == "relu" else np.asarray(jax.nn.gelu(h, approximate=False))
            out[t] += float(w[t, k]) * (a @ w_out[e])
    return out


def main():
    assert kernels_available(), "needs an sm_90 GPU and the CUDA module"
    os.environ["MOE_GROUPED_GEMM_TILE"] = "decode"  # the fused kernels for every case
    key = jax.random.PRNGKey(0)
    for form, dtype in ((form, dtype) for form in FORMS for dtype in (jnp.bfloat16, jnp.float16)):
        os.environ["JAX_MOE_PERMUTE_DECODE_MLP"] = form  # read at launch; every case traces afresh
        for activation in decode_mlp.ACTIVATION_CODES:
            width = 2 if activation in ("swiglu", "geglu") else 1
            for T, E, K, H, F in CASES:
                k1, k2, k3, k4, k5, key = jax.random.split(key, 6)
                x = jax.random.normal(k1, (T, H)).astype(dtype)
                w = jax.random.uniform(k2, (T, K))
                ids = np.array(jax.random.randint(k3, (T, K), 0, E))
                ids[0, 0], ids[-1, -1] = -1, E  # outside the experts
                if K > 1:
                    ids[T // 2, 1] = ids[T // 2, 0]  # repeated
                w_in = (jax.random.normal(k4, (E, H, width * F)) * H ** -0.5).astype(dtype)
                w_out = (jax.random.normal(k5, (E, F, H)) * F ** -0.5).astype(dtype)
                f = jax.jit(lambda *a: jmp.moe_mlp(*a, activation=activation))
                assert "jax_moe_permute.moe_mlp_decode" in f.lower(x, w, ids, w_in, w_out).as_text()
                out = np.asarray(f(x, w, jnp.asarray(ids), w_in, w_out), np.float64)
                ref = reference(x, w, ids, w_in, w_out, activation)
                tol = 3e-2 * max(1.0, float(np.abs(ref).max()))
                assert np.abs(out - ref).max() <= tol, (form, dtype, activation, T, E, K, H, F)
            # The stacked form on the first case: layer 2 of 3, as 2, -1 (from the end) and 7 (clamped).
            T, E, K, H, F = CASES[0]
            k1, k2, k3, k4, k5, key = jax.random.split(key, 6)
            x = jax.random.normal(k1, (T, H)).astype(dtype)
            w = jax.random.uniform(k2, (T, K))
            ids = np.array(jax.random.randint(k3, (T, K), 0, E))
            stack_in = (jax.random.normal(k4, (3, E, H, width * F)) * H ** -0.5).astype(dtype)
            stack_out = (jax.random.normal(k5, (3, E, F, H)) * F ** -0.5).astype(dtype)
            f = jax.jit(lambda x, w, ids, wi, wo, i: jmp.moe_mlp(x, w, ids, wi, wo, activation=activation, layer=i))
            assert "moe_mlp_decode_stacked" in f.lower(x, w, ids, stack_in, stack_out, 2).as_text()
            ref = reference(x, w, ids, stack_in[2], stack_out[2], activation)
            tol = 3e-2 * max(1.0, float(np.abs(ref).max()))
            for layer in (2, -1, 7):
                out = np.asarray(f(x, w, jnp.asarray(ids), stack_in, stack_out, layer), np.float64)
                assert np.abs(out - ref).max() <= tol, (form, dtype, activation, "stacked", layer)
            # With the block's residual added in the last launch.
            g = jax.jit(lambda x, w, ids, wi, wo: jmp.moe_mlp(x, w, ids, wi, wo, activation=activation, layer=2,
                                                               residual=x))
            assert "moe_mlp_decode_stacked_residual" in g.lower(x, w, ids, stack_in, stack_out).as_text()
            out = np.asarray(g(x, w, jnp.asarray(ids), stack_in, stack_out), np.float64)
            assert np.abs(out - ref - np.asarray(x, np.float64)).max() <= tol, (form, dtype, activation, "residual")
    print("SANITIZE DECODE MLP CASES DONE")


if __name__ == "__main__":
    main()
