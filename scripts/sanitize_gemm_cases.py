"""Small grouped-GEMM cases for compute-sanitizer (memcheck, racecheck, initcheck):

    compute-sanitizer --tool memcheck --target-processes application-only python3 scripts/sanitize_gemm_cases.py [TILE ...]

(every tile of grouped_gemm.TILES, the decode kernel and the persistent weight-gradient kernel
with each epilogue, dw:persistent-tma and dw:persistent-registers, and its gathered form,
dw:gathered, unless some are named: racecheck is slow on these kernels)

Forward, d lhs and dW kernels (bf16 and f16, each tile forced on all three) with empty groups, rows past the sum, a single
group, partial tiles in every dimension and a vmapped batch with a broadcast rhs. Checks each
result against jax.lax.ragged_dot in float32 so an uninitialised read also shows as a mismatch."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp
from jax_moe_permute import gather_gemm
from jax_moe_permute.gemm_primitives import DW_EPILOGUES
from jax_moe_permute.grouped_gemm import DECODE_TILE, TILES, kernels_available

CASES = [  # (M, K, N, group sizes)
    (100, 64, 72, [30, 0, 50, 0]),  # empty groups, 20 rows past the sum
    (64, 136, 264, [64]),  # one group, partial tiles in K and N
    (5, 32, 16, [0, 2, 0, 0, 3, 0, 0, 0]),  # decode-like
    (0, 16, 8, [0, 0]),  # no rows
    (150, 128, 192, [70, 0, 64, 0, 1]),  # K, N multiples of 64 (the persistent dW kernel's), partial stages
    (150, 128, 192, [40, 20, 55, 0, 17]),  # partial stages issuing 3, 2, 4 and 2 of their 16-row steps
]
# Our persistent dW kernel forced (docs/grouped-gemm.md), with each epilogue.
DW_VARIANTS = {f"dw:persistent-{e}": {"MOE_GROUPED_GEMM_DW_KERNEL": "persistent", "MOE_SM90_WGRAD_EPILOGUE": e}
               for e in DW_EPILOGUES}
GATHERED = "dw:gathered"  # gather_gemm.gathered_wgrad: the persistent kernel reading lhs through a row index
ENV = ("MOE_GROUPED_GEMM_TILE", "MOE_GROUPED_GEMM_DW_TILE", "MOE_GROUPED_GEMM_DW_KERNEL", "MOE_SM90_WGRAD_EPILOGUE")


def check(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    tol = 2e-2 if dtype == jnp.bfloat16 else 3e-3
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max(initial=0))))


def main():
    assert kernels_available(), "needs an sm_90 GPU and the CUTLASS kernels"
    for tile in sys.argv[1:] or TILES + (DECODE_TILE,) + tuple(DW_VARIANTS) + (GATHERED,):
        for variable in ENV:
            os.environ.pop(variable, None)
        if tile == GATHERED:
            run_gathered_cases(np.random.default_rng(0))
            continue
        if tile in DW_VARIANTS:
            os.environ.update(DW_VARIANTS[tile])
            jax.clear_caches()  # the dW kernel is chosen when a call is compiled
        else:
            os.environ["MOE_GROUPED_GEMM_TILE"] = tile  # read by the kernels at every call
            if tile != DECODE_TILE:  # the decode kernel is the forward's only; dW keeps its rule
                os.environ["MOE_GROUPED_GEMM_DW_TILE"] = tile
        run_cases(jax.random.PRNGKey(0))
    print("SANITIZE GEMM CASES DONE")


def run_cases(key):
    for dtype in (jnp.bfloat16, jnp.float16):
        for M, K, N, sizes in CASES:
            k1, k2, k3, key = jax.random.split(key, 4)
            lhs = jax.random.normal(k1, (M, K)).astype(dtype)
            rhs = jax.random.normal(k2, (len(sizes), K, N)).astype(dtype)
            ct = jax.random.normal(k3, (M, N)).astype(dtype)
            gs = jnp.asarray(sizes, jnp.int32)
            f = lambda a, b: jmp.ragged_dot(a, b, gs)
            out, vjp = jax.vjp(f, lhs, rhs)
            d_lhs, d_rhs = vjp(ct)
            ref = lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=jax.lax.Precision.HIGHEST)
            f32 = lambda x: x.astype(jnp.float32)
            r_out, r_vjp = jax.vjp(ref, f32(lhs), f32(rhs))
            r_lhs, r_rhs = r_vjp(f32(ct))
            for o, r in ((out, r_out), (d_lhs, r_lhs), (d_rhs, r_rhs)):
                check(o, r, dtype)
        lhs = jax.random.normal(key, (3, 48, 32)).astype(dtype)
        rhs = jax.random.normal(key, (4, 32, 24)).astype(dtype)
        gs = jnp.array([[10, 0, 20, 5], [0, 0, 48, 0], [1, 1, 1, 1]], jnp.int32)
        out = jax.vmap(jmp.ragged_dot, (0, None, 0))(lhs, rhs, gs)
        for v in range(3):
            check(out[v], jax.lax.ragged_dot(lhs[v].astype(jnp.float32), rhs.astype(jnp.float32), gs[v]), dtype)


def run_gathered_cases(rng):
    """gathered_wgrad on the kernel, lhs or rhs gathered: inputs copied from the host and the kernel's output copied back
    (initcheck restricted to the kernel, `--kernel-name kns=grouped_wgrad`, then sees every write
    its loads depend on), against a float64 reference; tokens -1 and T among the rows."""
    for dtype in (jnp.bfloat16, jnp.float16):
        for M, K, N, sizes in CASES:
            if K % 64 or N % 64:
                continue
            T = max(M // 2, 1)
            tokens = rng.integers(-1, T + 1, M).astype(np.int32)
            starts = np.minimum(np.cumsum([0] + sizes), M)
            for gather_rhs in (False, True):  # the first GEMM's dW (x's rows) and the second's (ct's)
                x = (rng.standard_normal((T, N if gather_rhs else K), np.float32)).astype(dtype)
                other = (rng.standard_normal((M, K if gather_rhs else N), np.float32)).astype(dtype)
                assert gather_gemm.gathered_wgrad_kernel_fits(x, M, K, N, len(sizes))
                lhs, rhs = (other, x) if gather_rhs else (x, other)
                f = jax.jit(functools.partial(gather_gemm.gathered_wgrad, gather_rhs=gather_rhs))
                out = f(*map(jax.device_put, (lhs, tokens, rhs, np.asarray(sizes, np.int32))))
                rows = np.where(((tokens >= 0) & (tokens < T))[:, None], x.astype(np.float64)[np.clip(tokens, 0, T - 1)],
                                0)
                a64, b64 = (other.astype(np.float64), rows) if gather_rhs else (rows, other.astype(np.float64))
                ref = np.stack([a64[a:b].T @ b64[a:b] for a, b in zip(starts[:-1], starts[1:])])
                check(out, ref, dtype)


if __name__ == "__main__":
    main()
