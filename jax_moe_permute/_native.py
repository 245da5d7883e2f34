"""Loads the compiled modules and registers their XLA FFI targets with jax."""

from __future__ import annotations

import jax

from . import _cpu

try:
    from . import _cuda
except ImportError:  # built without nvcc
    _cuda = None

TARGET_PREFIX = "jax_moe_permute."
_MODULES = {"cpu": _cpu, "cuda": _cuda}

for _platform, _module in _MODULES.items():
    if _module is None:
        continue
    for _name, _capsule in _module.registrations().items():
        jax.ffi.register_ffi_target(
            TARGET_PREFIX + _name, _capsule, platform=_platform.upper() if _platform == "cuda" else _platform
        )


def platforms() -> list[str]:
    """The lowering platforms that have compiled kernels."""
    return [p for p, m in _MODULES.items() if m is not None]


def target(op: str) -> str:
    return TARGET_PREFIX + op


def workspace_bytes(platform: str, op: str, *sizes: int) -> int:
    """Bytes of scratch the `op` kernel of `platform` needs (passed as an extra FFI result)."""
    return int(getattr(_MODULES[platform], f"{op}_workspace_bytes")(*sizes))
