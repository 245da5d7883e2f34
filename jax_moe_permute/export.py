"""Exporting programs that call our kernels with `jax.export` (to serialize a serving step, say)."""

from __future__ import annotations

from jax import export as _export

from . import _native


def disabled_checks() -> list:
    """`jax.export.export(fn, disabled_checks=...)` for a program that calls our kernels.

    jax.export refuses custom calls outside its list of targets with compatibility guarantees;
    ours are XLA FFI handlers whose interface follows this package's version. So an exported
    program needs jax_moe_permute imported (which registers the handlers) where it is
    deserialized and run, at the version it was exported with, and it holds the kernels chosen
    when it was lowered: export on the platform and GPU kind it will run on."""
    return [_export.DisabledSafetyCheck.custom_call(name) for name in _native.targets()]
