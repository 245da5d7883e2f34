"""Small cases for compute-sanitizer (scripts/sanitize.sh) on route_tokens' fused router product
and choice (cpp/router.cu, router_hidden; sm_90 only): each forced onto the kernel, past the
router-size rule, and checked against route on the logits it returns.

Arguments name the cases to run (route0 .. route5, stacked0, stacked1; default all), e.g.
`scripts/sanitize.sh DIR sanitize_router_cases:route5` runs one case in its own process."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp
from jax_moe_permute import gemm_primitives, router_kernel


def on_device(rng, shape, dtype=np.float32, scale=1.0):
    """Inputs written by host-to-device copies: initcheck restricted to the kernel (`--kernel-name
    kns=router_hidden`) then sees every write its loads depend on."""
    return jax.device_put((rng.standard_normal(shape, np.float32) * scale).astype(dtype))


def run_route_tokens(T, H, E, K, seed=0, **kw):
    """route_tokens' fused product and choice (sm_90) and its gradient, the ids against route on
    the logits the kernel returns, computed on the host's CPU (an uninitialised read shows as a
    mismatch)."""
    rng = np.random.default_rng(seed)
    x = on_device(rng, (T, H), jnp.bfloat16)
    router = on_device(rng, (H, E), jnp.bfloat16, H ** -0.5)
    if kw.pop("with_bias", False):
        kw["bias"] = on_device(rng, (E,), scale=0.3)
    args = dict(dict(scoring="softmax", renormalize=True, num_groups=None, topk_groups=None,
                     routed_scaling_factor=1.0), **kw)
    bias = args.pop("bias", None)
    logits, weights, ids = jax.jit(lambda x, r, b: router_kernel.router_hidden(x, r, b, K, **args))(x, router, bias)
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.device_put((logits, bias), cpu)
    want = jax.jit(lambda z, b: jmp.route(z, K, bias=b, **args)[:2])(*on_cpu)
    # The host's exp may round the last bit otherwise (tests/ compares on the GPU, bit for bit).
    assert np.array_equal(np.asarray(ids), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want[0]), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jmp.route_tokens(x, router, K, bias=bias, **args).weights ** 2)))(x)
    grad.block_until_ready()  # XLA's kernels write it: not copied to the host
    return [a.shape for a in (logits, ids, grad)]


ROUTE_TOKENS_CASES = [
    dict(T=1, H=2048, E=128, K=8),  # Qwen3: a cluster of 16
    dict(T=3, H=100, E=24, K=24),  # K = E, 2 blocks of 64 rows, 3 columns a row
    dict(T=8, H=7168, E=256, K=8, scoring="sigmoid", with_bias=True, num_groups=8, topk_groups=4),
    dict(T=5, H=5, E=8, K=1),  # one block, rows past H
    dict(T=2, H=3000, E=8, K=2),  # one column a row: 32 lanes of a column add by shuffles
    dict(T=4, H=1000, E=64, K=6),  # 8 columns a row: 4 lanes a column
]


def run_stacked(T, H, E, K, layers=3, seed=1, **kw):
    """The stacked form (routers and biases over `layers` layers, the layer read on the device):
    equal to the one-router call on the layer's slice, for the last layer, as itself, as -1 (from
    the end) and past the stack (clamped)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k[0], (T, H)).astype(jnp.bfloat16)
    router = (jax.random.normal(k[1], (layers, H, E)) * H ** -0.5).astype(jnp.bfloat16)
    bias = jax.random.normal(k[2], (layers, E)) * 0.3 if kw.pop("with_bias", False) else None
    f = jax.jit(lambda x, r, b, i: jmp.route_tokens(x, r, K, bias=b, layer=i, **kw))
    assert "router_hidden_stacked" in f.lower(x, router, bias, 0).as_text()
    want = jmp.route_tokens(x, router[-1], K, bias=None if bias is None else bias[-1], **kw)
    for layer in (layers - 1, -1, layers + 4):
        got = f(x, router, bias, layer)
        assert np.array_equal(np.asarray(got.ids), np.asarray(want.ids))
        assert np.array_equal(np.asarray(got.weights), np.asarray(want.weights))
    return [np.asarray(a).shape for a in (got.ids, got.weights)]


STACKED_CASES = [
    dict(T=1, H=2048, E=128, K=8),
    dict(T=2, H=512, E=64, K=4, scoring="sigmoid", with_bias=True, num_groups=8, topk_groups=4),
]
CASES = {**{f"route{i}": (run_route_tokens, c) for i, c in enumerate(ROUTE_TOKENS_CASES)},
         **{f"stacked{i}": (run_stacked, c) for i, c in enumerate(STACKED_CASES)}}


if __name__ == "__main__":
    unknown = [name for name in sys.argv[1:] if name not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; cases: {' '.join(CASES)}")
    if gemm_primitives.gpu_is_sm90():
        with router_kernel.hidden_kernel_wherever_it_fits():  # every case on the kernel
            for name in sys.argv[1:] or CASES:
                run, case = CASES[name]
                print(name, case, run(**case))
    print("SANITIZE CASES DONE")
