"""Prints how many of our custom calls a program lowers to, plain, vmapped and differentiated,
and whether any `while` loop appears (vmap must stay one launch per op)."""

import re

import jax
import jax.numpy as jnp

import jax_moe_permute as jmp

E, T, K, H, B = 8, 64, 2, 32, 4


def layer(h, ids, w):
    res = jmp.moe_permute(h, ids, E, align_size=4)
    return jmp.moe_unpermute(res.hidden * 2.0, res.row_map, w)


def loss(h, ids, w):
    return jnp.sum(layer(h, ids, w) ** 2)


def calls(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    names = re.findall(r"custom_call @jax_moe_permute\.(\w+)", text)
    return f"{len(names)} custom calls {sorted(names)}; while loop: {'while' in text}"


if __name__ == "__main__":
    one = (jnp.ones((T, H)), jnp.zeros((T, K), jnp.int32), jnp.ones((T, K)))
    batch = (jnp.ones((B, T, H)), jnp.zeros((B, T, K), jnp.int32), jnp.ones((B, T, K)))
    grad = jax.grad(loss, argnums=(0, 2))
    print("forward         ", calls(layer, *one))
    print("vmap(forward)   ", calls(jax.vmap(layer), *batch))
    print("grad            ", calls(grad, *one))
    print("vmap(grad)      ", calls(jax.vmap(grad), *batch))
    print("jit(vmap(grad)) ", calls(jax.jit(jax.vmap(grad)), *batch))
