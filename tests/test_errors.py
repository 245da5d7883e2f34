"""Malformed calls raise at trace time, naming the offending argument."""

import jax
import jax.numpy as jnp
import pytest

import jax_moe_permute as jmp

H = jnp.ones((4, 8), jnp.bfloat16)
IDS = jnp.zeros((4, 2), jnp.int32)
X = jnp.ones((8, 8), jnp.float32)
RM = jnp.zeros((4, 2), jnp.int32)

PERMUTE_CASES = [
    (lambda: jmp.moe_permute(H[0], IDS, 4), ValueError, "hidden"),
    (lambda: jmp.moe_permute(H, IDS[:, 0], 4), ValueError, "topk_ids"),
    (lambda: jmp.moe_permute(H.astype(jnp.int32), IDS, 4), TypeError, "hidden"),
    (lambda: jmp.moe_permute(H.astype(jnp.float64) if jax.config.jax_enable_x64 else H.astype(jnp.int8), IDS, 4),
     TypeError, "hidden"),
    (lambda: jmp.moe_permute(H, IDS.astype(jnp.float32), 4), TypeError, "topk_ids"),
    (lambda: jmp.moe_permute(H, IDS[:3], 4), ValueError, "T"),
    (lambda: jmp.moe_permute(H, IDS, 0), ValueError, "num_experts"),
    (lambda: jmp.moe_permute(H, IDS, 4.5), TypeError, "num_experts"),
    (lambda: jmp.moe_permute(H, IDS, 4, align_size=0), ValueError, "align_size"),
    (lambda: jmp.moe_permute(H, IDS, 4, expert_map=jnp.zeros(4, jnp.int32)), ValueError, "num_local_experts"),
    (lambda: jmp.moe_permute(H, IDS, 4, expert_map=jnp.zeros(5, jnp.int32), num_local_experts=2), ValueError,
     "expert_map"),
    (lambda: jmp.moe_permute(H, IDS, 4, expert_map=jnp.zeros((4, 1), jnp.int32), num_local_experts=2), ValueError,
     "expert_map"),
    (lambda: jmp.moe_permute(H, IDS, 4, expert_map=jnp.zeros(4), num_local_experts=2), TypeError, "expert_map"),
    (lambda: jmp.moe_permute(H, IDS, 4, num_local_experts=2), ValueError, "num_local_experts"),
    (lambda: jmp.moe_permute(H, IDS, 4, expert_map=jnp.zeros(4, jnp.int32), num_local_experts=0), ValueError,
     "num_local_experts"),
]

UNPERMUTE_CASES = [
    (lambda: jmp.moe_unpermute(X[0], RM), ValueError, "expert_out"),
    (lambda: jmp.moe_unpermute(X.astype(jnp.int32), RM), TypeError, "expert_out"),
    (lambda: jmp.moe_unpermute(X, RM[:, 0]), ValueError, "row_map"),
    (lambda: jmp.moe_unpermute(X, RM.astype(jnp.float32)), TypeError, "row_map"),
    (lambda: jmp.moe_unpermute(X, RM, jnp.ones((4, 3))), ValueError, "topk_weights"),
    (lambda: jmp.moe_unpermute(X, RM, jnp.ones((3, 2))), ValueError, "topk_weights"),
    (lambda: jmp.moe_unpermute(X, RM, jnp.ones((4, 2), jnp.int32)), TypeError, "topk_weights"),
    (lambda: jmp.moe_unpermute(X, RM, jnp.ones((4, 2), jnp.float8_e4m3fn)), TypeError, "topk_weights"),
    (lambda: jmp.moe_unpermute(X, RM, out_dtype=jnp.int32), TypeError, "out_dtype"),
]


@pytest.mark.parametrize("call,error,name", PERMUTE_CASES + UNPERMUTE_CASES)
def test_error_names_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


@pytest.mark.parametrize("call,error,name", PERMUTE_CASES[:3] + UNPERMUTE_CASES[:3])
def test_errors_raise_under_jit_at_trace_time(call, error, name):
    with pytest.raises(error, match=name):
        jax.jit(call).lower()


def test_unsupported_dtype_lists_supported_ones():
    with pytest.raises(TypeError, match="bfloat16.*float8_e4m3fn"):
        jmp.moe_permute(H.astype(jnp.int16), IDS, 4)


def test_too_many_rows_is_a_value_error():
    big = jax.ShapeDtypeStruct((2**28, 1), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2**28, 8), jnp.int32)
    with pytest.raises(ValueError, match="rows"):
        jax.eval_shape(lambda h, i: jmp.moe_permute(h, i, 8), big, ids)
