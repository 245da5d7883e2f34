"""Shared helpers: fresh random inputs (never zeros) and exact/approximate comparisons."""

import itertools
import os

# Allocate as needed, not XLA's 75% up front: tests that start a process of their own (the
# benchmarks) need GPU memory too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Reference matmuls in the tests (ragged_dot, einsum) must not use TF32 on GPUs.
jax.config.update("jax_default_matmul_precision", "highest")

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]
WEIGHT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

_seed = itertools.count(1234)


def fresh_key():
    """A new PRNG key per call, so no two inputs in a run repeat."""
    return jax.random.PRNGKey(next(_seed))


def random_float(shape, dtype, scale=1.0):
    x = jax.random.normal(fresh_key(), shape, jnp.float32) * scale + 0.25
    return x.astype(dtype)


def random_ids(T, K, E, low=-2, high_extra=2, dtype=jnp.int32):
    """Expert ids in [low, E + high_extra): invalid ids and duplicates included."""
    return jax.random.randint(fresh_key(), (T, K), low, E + high_extra).astype(dtype)


def random_expert_map(E, L):
    """Each global expert maps to a local one in [0, L) or to -1 (about half)."""
    local = jax.random.randint(fresh_key(), (E,), -L, L)
    return jnp.where(local < 0, -1, local).astype(jnp.int32)


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_close(a, b, dtype):
    a = np.asarray(a).astype(np.float32)
    b = np.asarray(b).astype(np.float32)
    assert a.shape == b.shape
    tol = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 1e-2}.get(
        jnp.dtype(dtype), 1.5e-1)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def on_gpu():
    return jax.default_backend() == "gpu"


needs_gpu = pytest.mark.skipif(not on_gpu(), reason="needs a CUDA GPU visible to jax")
