"""The primitives' reference lowering (used on platforms without our kernels) computes what the
kernels compute, batched operands and broadcast (extent-1) operands included."""

import jax
import jax.numpy as jnp

from jax_moe_permute import lowering, primitives as P
from conftest import assert_bits_equal, assert_close, random_expert_map, random_float, random_ids

B, T, K, H, E, L = 3, 21, 3, 6, 7, 4


def test_reference_lowering_of_permute():
    hidden = random_float((1, T, H), jnp.bfloat16)  # broadcast over the batch
    ids = random_ids(B * T, K, E).reshape(B, T, K)
    maps = jnp.stack([random_expert_map(E, L) for _ in range(B)])
    params = dict(num_experts=E, num_local_experts=L, align_size=4, has_map=1)
    got = jax.jit(lambda *a: P.permute_p.bind(*a, **params))(hidden, ids, maps)
    want = lowering.reference_permute(hidden, ids, maps, **params)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)


def test_reference_lowering_of_the_linear_ops():
    R = 17
    x_rows = random_float((B, R, H), jnp.float32)
    x_tokens = random_float((1, T, H), jnp.float32)
    row_map = random_ids(B * T, K, R).reshape(B, T, K)
    weights = random_float((B, T, K), jnp.float32)
    cases = [
        (P.unpermute_p, (x_rows, row_map, weights), dict(out_dtype=jnp.dtype(jnp.float32), has_weights=1), lowering.reference_unpermute),
        (P.scatter_p, (x_tokens, row_map, weights), dict(num_rows=R, out_dtype=jnp.dtype(jnp.float32), has_weights=1),
         lowering.reference_scatter),
        (P.weight_grad_p, (x_tokens, x_rows, row_map), dict(out_dtype=jnp.dtype(jnp.float32)), lowering.reference_weight_grad),
    ]
    for prim, args, params, ref in cases:
        got = jax.jit(lambda *a: prim.bind(*a, **params))(*args)
        assert_close(got, ref(*args, **params), jnp.float32)
