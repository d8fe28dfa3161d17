"""Errors the engine raises at start that a supervisor must not retry."""
from __future__ import annotations

# sysexits.h EX_CONFIG: the worker cannot start with this configuration; restarting it would fail the same way.
EXIT_CONFIG = 78


class MemoryBudgetError(RuntimeError):
    """The worker's memory budget cannot hold the weights, the profiled activations and a minimal KV pool."""


class ConfigError(ValueError):
    """An engine configuration this machine can never run (checked at start, before anything loads)."""
