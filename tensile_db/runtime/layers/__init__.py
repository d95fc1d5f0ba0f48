"""Layer kinds, one module each, found by :mod:`.base`'s registries. Every module of this package
is imported here, so a new kind is a new module and nothing else of the runtime changes."""

from __future__ import annotations

import importlib
import pkgutil

from .base import INPUT, KINDS, MAX_DEPTH, MAX_WIDTH, MAX_WINDOW, OPS, Node  # noqa: F401

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
