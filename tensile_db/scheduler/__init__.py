"""Scheduling of tensors: which tensor leaves the device when memory is short, and when.

``reactive.py`` holds the only policy so far: evict the resident tensor whose next access, read
off the owning job's access sequence (``runtime.program.Program``), is farthest away. Planned
swap-out / swap-in and recompute (TENSILE) are not built yet; they will use the same sequences.
"""
