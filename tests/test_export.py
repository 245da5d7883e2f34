"""jax.export of programs that call our kernels: refused without `export.disabled_checks()`, and
with it the exported forward and gradient, called back, equal the jitted ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_moe_permute as jmp
from conftest import random_float

T, H, F, E, K = 12, 16, 8, 4, 2


def layer(x, router, w_in, w_out):
    r = jmp.route_tokens(x, router, K)
    return jmp.moe_mlp(x, r.weights, r.ids, w_in, w_out)


def test_export_and_call_back():
    args = (random_float((T, H), jnp.float32), random_float((H, E), jnp.float32),
            random_float((E, H, 2 * F), jnp.float32), random_float((E, F, H), jnp.float32))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 2, 3)))
    with pytest.raises(ValueError, match="custom calls"):
        export.export(jax.jit(layer))(*args)
    for fn in (jax.jit(layer), grad):
        exported = export.export(fn, disabled_checks=jmp.export.disabled_checks())(*args)
        assert "jax_moe_permute." in exported.mlir_module()  # our kernels, not a reference lowering
        for got, want in zip(jax.tree.leaves(exported.call(*args)), jax.tree.leaves(fn(*args))):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
