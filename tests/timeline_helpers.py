"""Shared set-up of the tests that price hand-made decisions on a small timeline: one job of a
three-layer MLP whose ops each take :data:`OP_S`, swaps of :data:`N` bytes, and a duplex cost
model (:data:`PLAIN`) that copies them in 1 ms each way."""

from __future__ import annotations

from tensile_db.runtime.builder import ProgramBuilder
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence

SPEC = ModelSpec(Architecture((Layer(96, "relu"), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4, "classification")
OPTIONS = TrainOptions(epochs=1, batch_size=64, optimizer="adam", lr=0.005, seed=11)
OP_S = 1e-3
N = 1_000_000                   # bytes of each hand-made swap: 1 ms each way at 1 GB/s
PLAIN = CostModel(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex=True)


def timeline() -> Timeline:
    """The job's timeline, every op measured at :data:`OP_S` seconds: the program with one slot per
    parameter (28 ops), which the tests' hand-made decisions are placed on."""
    seq = AccessSequence(ProgramBuilder(SPEC, OPTIONS, 64).program())
    for p in range(len(seq.program.ops)):
        seq.record(p, OP_S)
    seq.end_iteration()
    return Timeline([JobTrace(1, seq)])
