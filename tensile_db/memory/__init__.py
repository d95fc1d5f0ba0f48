"""Device memory: the arena and its allocator (``arena.py``) and the tensor registry that keeps
every job inside the budget by swapping tensors between the arena and host memory
(``manager.py``). Device byte counters change in exactly one place: ``MemoryManager._account``."""
