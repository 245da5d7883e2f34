"""The main job: check both ops against the reference on the default backend, then time
ours against the reference on a few sizes.  Run: python -m jax_moe_permute"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp
from jax_moe_permute import bench


def check(seed: int) -> str:
    rng = np.random.default_rng(seed)
    T, H, E, K = int(rng.integers(1, 300)), int(rng.integers(1, 100)), int(rng.integers(1, 64)), int(rng.integers(1, 9))
    A = int(rng.choice([1, 4, 128]))
    hidden = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, E + 1, (T, K)), jnp.int32)
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    got = jax.jit(lambda h, i: jmp.moe_permute(h, i, E, align_size=A))(hidden, ids)
    want = jmp.reference.moe_permute(hidden, ids, E, align_size=A)
    for g, w in zip(got, want):
        if not np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)):
            raise AssertionError(f"moe_permute differs from the reference at T={T} H={H} E={E} K={K} A={A}")
    out = jax.jit(jmp.moe_unpermute)(got.hidden, got.row_map, weights)
    ref = jmp.reference.moe_unpermute(got.hidden, got.row_map, weights)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
    return f"T={T} H={H} E={E} K={K} A={A}"


def main() -> int:
    print(f"jax {jax.__version__}, backend {jax.default_backend()}: {jax.devices()[0].device_kind}")
    for seed in range(5):
        print("ok  ", check(seed))
    print()
    return bench.main(["--model", "mixtral,qwen3", "--tokens", "1,64,1024", "--ops", "permute,unpermute"]
                      + sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
