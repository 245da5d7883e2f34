"""Loads the compiled modules and registers their XLA FFI targets with jax."""

from __future__ import annotations

import importlib.util
import os
import sys

import jax

from . import __path__ as _package_path


def _add_installed_copy() -> None:
    """Run from a source checkout (python -m jax_moe_permute in the repo root), the package
    is imported from the sources, which hold no compiled modules: let it find the installed
    copy's."""
    here = os.path.realpath(_package_path[0])
    if any(f.startswith("_cpu.") for f in os.listdir(here)):
        return
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "jax_moe_permute")
        if os.path.isdir(candidate) and os.path.realpath(candidate) != here:
            _package_path.append(candidate)


_add_installed_copy()
if importlib.util.find_spec("jax_moe_permute._cpu") is None:
    raise ImportError("jax_moe_permute: the compiled module _cpu is missing; install the package with "
                      "`pip install --no-build-isolation .` (see README.md)")
from . import _cpu  # noqa: E402

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


def targets() -> list[str]:
    """The names of every FFI target registered here, on any platform."""
    return sorted({target(op) for m in _MODULES.values() if m is not None for op in m.registrations()})


def platforms() -> list[str]:
    """The lowering platforms that have compiled kernels."""
    return [p for p, m in _MODULES.items() if m is not None]


def has_target(platform: str, op: str) -> bool:
    module = _MODULES.get(platform)
    return module is not None and op in module.registrations()


def target(op: str) -> str:
    return TARGET_PREFIX + op


def workspace_bytes(platform: str, op: str, *sizes: int) -> int:
    """Bytes of scratch the `op` kernel of `platform` needs (passed as an extra FFI result)."""
    return int(getattr(_MODULES[platform], f"{op}_workspace_bytes")(*sizes))


def kernel_fits(platform: str, op: str, *sizes: int) -> bool:
    """Whether the `op` kernel of `platform` takes these sizes (its launcher's own rule)."""
    return bool(getattr(_MODULES[platform], f"{op}_fits")(*sizes))


def kernel_preferred(platform: str, op: str, *sizes: int) -> bool:
    """Whether the `op` kernel of `platform` is the default choice for these sizes (its own rule)."""
    return bool(getattr(_MODULES[platform], f"{op}_preferred")(*sizes))
