"""The training program of a network: forward, loss, backward and optimizer steps over slots.

:func:`build_training_program` walks the network's nodes (:mod:`.network`) in execution order,
then backwards, and emits one :class:`~.program.Op` per kernel call. Branches are no special
case: a node's output slot lives until its last reader (the program's lifetimes follow from the
op order), and a node read by several others (a residual's input, a dense block's features)
collects its gradient from each: the first contribution writes the gradient slot, each later one
writes a temporary that an ``accumulate`` op adds in.

Slots, for node ``i``: ``h{i}`` its output (``d{i}`` after its dropout, with the mask
``mask{i}``; ``z{i}`` before an activation that keeps its input), ``g{i}`` the gradient of the slot
its readers read, ``gz{i}`` the gradient before its activation; the rest are its op's
(:mod:`.layers`: workspaces ``ws{i}`` / ``wsb{i}``, a max pool's argmax ``am{i}``, batch
normalisation's batch statistics ``bm{i}`` / ``bs{i}``, ...). A node's parameters are one slot,
``params{i}``, as are their gradients ``dparams{i}`` and each optimizer state (``adam_m_params{i}``
...), where that does not raise the program's largest working set (Note [One tensor per node's
parameters]); else each parameter is a slot of :mod:`.network`'s name (``W{i}``, its gradient
``dW{i}``, ``adam_m_W{i}`` ...). A step that would hold more than the largest op of the forward and
backward passes runs in sub-groups, each with its own slots of state (``adam_m_W{i}.0`` ...: Note
[Optimizer steps in sub-groups]). An op that must not run twice (batch normalisation's, which updates
the running statistics) carries a *replay* op that recomputes its output exactly; workspaces are
not inputs of a recipe: a replay allocates its own.

Note [One tensor per node's parameters]
---------------------------------------
Rationale: every tensor the scheduler moves costs its own decisions, copies and bookkeeping,
whatever its size, and a network's biases, normalisation scales and their gradients and optimizer
state are many small tensors. The MLP of ``bench/throughput.py`` at its largest working set (Adam
on the 512 x 512 layer: everything else must leave the device for it) swapped 28 tensors out and
in an iteration, 19 of them under 100 KB, for 4.4 MiB each way; a small one's cycle cost about
29 µs in the run against 3 µs of copying.

Approach: the parameters of a node with more than one (a dense layer's ``W{i}`` and ``b{i}``, a
normalisation's ``gamma{i}`` and ``beta{i}``) are one float32 slot ``params{i}``, their elements
one after another in the node's order, and so are their gradients (``dparams{i}``) and each
optimizer state; one optimizer step per node (or per sub-group of its state: Note [Optimizer steps
in sub-groups]) runs over the flat slots, elementwise, so the values
are those of one step per parameter, bit for bit. The layers' ops still name the parameters:
:meth:`ProgramBuilder.make_op` reads and writes the flat slot for them and hands the kernel views
of it under their names. FSDP's flat parameters (Zhao et al., "PyTorch FSDP", VLDB 2023, section
3.2) and multi-tensor optimizer steps do the same for the same reason.

An op that reads one parameter of a node (a layer's backward reads its weight, not its bias) holds
them all, and a joined optimizer step holds the bias's state beside the weight's. Where that would
raise the program's largest working set, which is the least budget it can run in, the node keeps
one slot per parameter: :func:`build_training_program` builds the program with every node joined,
then again without the nodes whose slots an op above the separate program's largest working set
accesses. Joining every node raised the small CNN's (a convolution's backward, 512 bytes more
with the bias) and at that working set the planned pool found no packing of the period in the
budget, 9,728 bytes over in every order tried, so the CNN ran on the reactive fallback: 1.33 to
1.37 times its unlimited time at half its peak, against 1.19 to 1.26.

Measured (``bench/throughput.py``, five repeats, six runs alternated with the program of one slot
per parameter; the runs' medians; before the optimizer steps ran in sub-groups, Note [Optimizer
steps in sub-groups]): the MLP at its largest working set swaps 17 tensors an
iteration instead of 28, the same bytes (its 512 x 512 layer keeps its slots: its optimizer step
is the largest op), in 1.30 to 1.36 times the unlimited run's time per iteration against 1.36 to
1.46, and its samples/s against PyTorch's went from 0.80 to 0.85 to 0.86 to 0.88; the small CNN
at half its peak swaps 46 tensors instead of 65, in 1.12 to 1.17 times its unlimited time against
1.18 to 1.22. On the simulated H100 (``bench/paper.py``) ResNet-50's program has 474 ops and
1,069 slots instead of 528 and 1,285, with the same largest working set; ``tensile``'s EOR moved
within the spread of the jitter's seeds (one ResNet-50 at 50%, seeds 0 to 4: 0.109 to 0.198
against 0.129 to 0.206), and the worst packing of a recorded period by the planned pool went from
1.055 to 1.042 times its most live bytes.

Limitations: a stored model keeps one array per parameter: the flat slots are filled from them when
a job starts and read back into them in its copies of its weights; a node with one parameter is
one slot as before; a node whose parameters stay apart to keep the largest working set keeps all
its small tensors apart (the MLP's 512 x 512 layer's bias, its gradient and moments: joined, they
would be held by the layer's backward, its largest op now). Building
the program takes two or three passes instead of one (DenseNet-121: 88 against 25 ms).

Note [Optimizer steps in sub-groups]
------------------------------------
Rationale: an optimizer step holds its parameter, the gradient and every state array (Adam's two
moments) at once, so a large layer's step can be the largest working set of the whole program,
which is the least budget the program can run in, and at that budget every other tensor must
leave the device for it. The MLP of ``bench/throughput.py``: Adam on its 512 x 512 layer held
4 MiB, against 2.75 MiB for the layer's backward, the largest op of the passes; at half the MLP's
peak the budget had to be raised to those 4 MiB, and the plan swapped 17 tensors an iteration,
4.4 MiB each way.

Approach: the step is elementwise, so it may run over parts of the parameter: where one step
would hold more than the largest op before the optimizer, its state is split into the fewest
sub-groups (at most :data:`MAX_SUBGROUPS`) whose steps hold no more, each sub-group a slot of its
own (``adam_m_W1.0`` ...) and a step of its own over that part of the parameter and the gradient
(views), in order; the values are those of one step, bit for bit. The parameter and its gradient
stay whole: the passes' ops read and write them whole. DeepSpeed's ZeRO-3 with offload
(Rajbhandari et al., ZeRO-Infinity, SC 2021) steps its optimizer over sub-groups of the flat
parameters (its ``sub_group_size``) to bound the step's working set the same way.

Measured (``bench/throughput.py``, five repeats, six runs alternated with one step per
parameter; the runs' medians): the MLP's largest working set went from 4,194,304 to 2,885,632
bytes (its 512 x 512 layer's step in three sub-groups), so half its peak (3,782,656 bytes) is a
budget it runs in as it is; there its plan swaps 10 tensors an iteration, 4.0 MiB each way, in 5.7
to 6.2 ms an iteration, 1.26 to 1.33 times its unlimited time, where before it took 5.8 to 6.3 ms,
1.33 to 1.35 times, in the 4 MiB it needed. Among the seed papers' networks only VGG-16's steps
are split (its first dense layer's, 392 MiB of weights, into 8 sub-groups), and its largest
working set went from 1,568 to 882 MiB: on the simulated H100 (``bench/paper.py``) it runs at 35%
of its peak, where no policy could before (``tensile``'s EOR +1.266, the least of them), and
``tensile``'s EOR at 70% and 50% went from +0.542 and +0.992 to +0.389 and +0.799.

Limitations: a step that the most sub-groups do not bring within the passes' largest op (VGG-16's)
stays the program's largest; each sub-group is one op more an iteration, which costs where memory
is plentiful (the MLP's unlimited run took about 3% longer an iteration with its two more ops,
4.75 against 4.6 ms, medians of six runs); a sub-group of fewer than
:data:`~.fused.PARALLEL_MIN_NELEMS` elements runs its fused step on one thread where the whole
would have run on the OpenMP team.
"""

from __future__ import annotations

import math

from . import conv_kernels as ck
from . import kernels, layout
from .layers.base import ACTIVATIONS
from .model import ModelSpec, TrainOptions
from .network import INPUT, Node
from .program import Kind, Op, Program, Slot
from .units import UNIT_NBYTES, round_up

#: most sub-groups one parameter's optimizer step is split into (Note [Optimizer steps in sub-groups]):
#: a step's working set then lies within an eighth of its state's bytes of the parameter and
#: gradient's it cannot go below (Adam: 2.25 against 2 times the parameter's bytes)
MAX_SUBGROUPS = 8
#: float32 elements in an arena unit: a sub-group's size is a whole number of them
UNIT_ELEMS = UNIT_NBYTES // 4


def build_training_program(spec: ModelSpec, options: TrainOptions, batch: int) -> Program:
    """The training iteration of ``spec`` at batch size ``batch``: load the batch, forward, loss,
    backward, and one optimizer step per node's parameters, or per sub-group of their state where
    one step would hold more than the passes' largest op (Note [Optimizer steps in sub-groups]);
    after the whole backward pass, as ``optimizer.step()`` in PyTorch.

    Activations run in place on their node's output (their backward needs only the output);
    dropout backward runs in place on the incoming gradient; activation backward writes a new
    gradient slot, since its kernels must not overwrite ``dy`` while reading it. A node's
    parameters are one slot where that does not raise the largest working set (Note [One tensor
    per node's parameters]): the program is built with every node's joined, then again without
    those of the nodes whose slots an op above the separate slots' largest working set accesses
    (their optimizer steps split in sub-groups against that working set too).
    """
    separate = ProgramBuilder(spec, options, batch, frozenset()).program()
    floor = separate.min_working_set_nbytes
    joined = frozenset(node.index for node in spec.network.nodes if len(node.params) > 1)
    while joined:
        builder = ProgramBuilder(spec, options, batch, joined, floor)
        program = builder.program()
        raising = {builder.flats[s][0] for i, op in enumerate(program.ops)
                   if program.working_set_nbytes(i) > floor for s in op.accesses if s in builder.flats}
        if not raising:
            return program
        joined -= raising
    return separate


def _with_views(run, views: tuple):
    """``run`` given, besides its arrays, each of ``views`` ((name, flat slot, first element,
    shape), Note [One tensor per node's parameters]) as a view of its slot's array: added to the
    caller's dict of arrays (a fresh one per op in a job; a test's dict keeps them)."""
    def viewed(a, ctx):
        for name, flat, start, shape in views:
            a[name] = a[flat][start:start + math.prod(shape)].reshape(shape)
        run(a, ctx)
    return viewed


class ProgramBuilder:
    """The training program being built: its slots and ops, each node's output slot (``out``) and
    gradient slot (``grad``). The layer kinds' training methods
    (:meth:`~.layers.base.NodeOp.forward` / :meth:`~.layers.base.NodeOp.backward`) emit their ops
    through :meth:`slot`, :meth:`op`, :meth:`make_op`, :meth:`workspace`, :meth:`params`,
    :meth:`gradients`, :meth:`dropout` and :meth:`contribution`."""

    def __init__(self, spec: ModelSpec, options: TrainOptions, batch: int, joined: frozenset = frozenset(),
                 floor_nbytes: int | None = None):
        self.spec, self.options, self.batch = spec, options, batch
        self.net = spec.network
        self.joined = joined                       # nodes whose parameters are one slot
        self.floor_nbytes = floor_nbytes           # an optimizer step holds at most this, where given
        self.slots: dict[str, Slot] = {}
        self.members: dict[str, tuple[str, int, tuple[int, ...]]] = {}   # name -> (flat slot, first element, shape)
        self.flats: dict[str, tuple[int, tuple[str, ...]]] = {}   # flat slot -> (its node, its members)
        self.ops: list[Op] = []
        self.out: dict[int, str] = {}              # node (or INPUT) -> the slot its readers read
        self.grad: dict[int, str] = {}             # node -> the gradient slot of ``out[node]``
        self.temps = 0
        self.pending: list[tuple[int, str]] = []   # (node, temporary) contributions not yet added in
        needs: dict[int, bool] = {INPUT: False}    # does a parameter depend on the node's output?
        for node in self.net.nodes:
            needs[node.index] = bool(node.params) or any(needs[j] for j in node.inputs)
        self.needs = needs

    def slot(self, name: str, kind: Kind, shape, dtype: str = "float32") -> str:
        self.slots[name] = Slot(name, kind, tuple(int(d) for d in shape), dtype)
        return name

    def op(self, name: str, reads, writes, run, replay: Op | None = None, flops: int = 0,
           unit: str = "elementwise", nbytes: int | None = None) -> None:
        self.ops.append(self.make_op(name, reads, writes, run, replay, flops, unit, nbytes))

    def make_op(self, name: str, reads, writes, run, replay: Op | None = None, flops: int = 0,
                unit: str = "elementwise", nbytes: int | None = None) -> Op:
        """An op costing ``flops`` (elementwise ops: one per element written, when 0) and
        ``nbytes``, by default the bytes of the slots it reads and writes, workspaces left out
        (:class:`Op`)."""
        flops = flops or sum(self.numel(s) for s in writes if self.kind(s) is not Kind.WORKSPACE)
        views = tuple((s, *self.members[s]) for s in dict.fromkeys(tuple(reads) + tuple(writes)) if s in self.members)
        if views:                       # parameters of a node joined into one slot: the op touches the slot
            for flat in {v[1] for v in views if self.slots[v[1]].kind is Kind.GRADIENT}:    # written whole
                assert set(self.flats[flat][1]) <= set(writes), \
                    f"op {name} writes part of {flat}: its gradients are written by one op"
            reads = dict.fromkeys(self.members[s][0] if s in self.members else s for s in reads)
            writes = dict.fromkeys(self.members[s][0] if s in self.members else s for s in writes)
            run = _with_views(run, views)
        if nbytes is None:
            nbytes = sum(self.slots[s].nbytes for s in tuple(reads) + tuple(writes)
                         if self.slots[s].kind is not Kind.WORKSPACE)
        return Op(name, tuple(reads), tuple(writes), run, replay, int(flops), int(nbytes), unit)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a slot or of a parameter (or its gradient) within a node's joined slot."""
        return self.members[name][2] if name in self.members else self.slots[name].shape

    def kind(self, name: str) -> Kind:
        return self.slots[self.members[name][0] if name in self.members else name].kind

    def numel(self, slot: str) -> int:
        return math.prod(self.shape(slot))

    def rows(self, shape) -> tuple[int, ...]:
        """The stored shape of a batch of rows of per-row ``shape`` (images channels last:
        :func:`.layout.stored`)."""
        return (self.batch, *layout.stored(shape))

    # -- the whole iteration ----------------------------------------------------------------------

    def program(self) -> Program:
        spec, batch = self.spec, self.batch
        classification = spec.task == "classification"
        x = self.slot("x", Kind.INPUT, self.rows(self.net.input_shape))
        y = self.slot("y", Kind.INPUT, (batch,) if classification else (batch, spec.n_outputs),
                      "int32" if classification else "float32")

        def load(a, ctx):
            ctx.device.to_device(layout.images_from_rows(ctx.batch_x, self.net.input_shape), a[x])
            ctx.device.to_device(ctx.batch_y, a[y])

        self.op("load_batch", (), (x, y), load, unit="load")
        self.out[INPUT] = x
        for node in self.net.nodes:
            self.forward(node)
        self.loss(classification, self.out[self.net.nodes[-1].index], y)
        for node in reversed(self.net.nodes):
            if self.needs[node.index]:
                self.backward(node)
        self.optimizer()
        return Program(self.slots, self.ops, {name: member for name, member in self.members.items()
                                              if self.slots[member[0]].kind is Kind.WEIGHT})

    def loss(self, classification: bool, logits: str, y: str) -> None:
        batch, n_out, last = self.batch, self.spec.n_outputs, self.net.nodes[-1].index
        loss = self.slot("loss", Kind.ACTIVATION, (1,))
        g_out = self.slot(f"gz{last}", Kind.GRADIENT, (batch, n_out))
        self.grad[last] = g_out
        if classification:
            probs = self.slot("probs", Kind.ACTIVATION, (batch, n_out))
            rowbuf = self.slot("rowbuf", Kind.WORKSPACE, (batch, 1))
            self.op("cross_entropy", (logits, y), (probs, rowbuf, loss),
                    lambda a, ctx: kernels.softmax_cross_entropy_forward(a[logits], a[y], a[probs], a[rowbuf],
                                                                         a[loss]))
            self.op("cross_entropy_backward", (probs, y), (g_out,),
                    lambda a, ctx: kernels.softmax_cross_entropy_backward(a[probs], a[y], a[g_out]))
        else:
            diff = self.slot("diff", Kind.ACTIVATION, (batch, n_out))
            self.op("mse", (logits, y), (diff, loss),
                    lambda a, ctx: kernels.mse_forward(a[logits], a[y], a[diff], a[loss]))
            self.op("mse_backward", (diff,), (g_out,), lambda a, ctx: kernels.mse_backward(a[diff], a[g_out]))

    # -- forward ------------------------------------------------------------------------------------

    def forward(self, node: Node) -> None:
        """The node's op (:meth:`~.layers.base.NodeOp.forward`) into ``h{i}`` (``z{i}`` when its
        activation keeps its input), its activation, then its dropout."""
        i = node.index
        h = self.slot(f"h{i}", Kind.ACTIVATION, self.rows(node.shape))
        act = ACTIVATIONS.get(node.activation)
        z = self.slot(f"z{i}", Kind.ACTIVATION, self.rows(node.shape)) if act and act.saves_input else h
        node.kind.forward(self, node, [self.out[j] for j in node.inputs], z)
        self.out[i] = h
        if act:
            self.op(f"{node.activation}{i}", (z,), (h,), lambda a, ctx: act.forward(a[z], a[h]))
        if node.dropout:
            d = self.slot(f"d{i}", Kind.ACTIVATION, self.rows(node.shape))
            self.dropout(i, h, d, node.dropout)
            self.out[i] = d

    def dropout(self, i: int, inp: str, out: str, p: float) -> None:
        mask = self.slot(f"mask{i}", Kind.ACTIVATION, self.slots[out].shape)

        def dropout_mask(a, ctx):
            ctx.device.uniform(ctx.seed * 4099 + i, a[mask])
            kernels.dropout_mask(a[mask], p, a[mask])

        # The mask is its own op, a function of the iteration's seed only, so a dropped mask
        # (and a dropped dropout output) is recomputed exactly from the same random stream.
        self.op(f"dropout_mask{i}", (), (mask,), dropout_mask)
        self.op(f"dropout{i}", (inp, mask), (out,),
                lambda a, ctx: kernels.dropout_forward(a[inp], a[mask], a[out]))

    def gradients(self, node: Node) -> tuple[str, ...]:
        """The gradients ``d{p}`` of the node's parameters, in their order: new slots, or parts
        of the node's joined gradient slot ``dparams{i}``."""
        if node.index in self.joined:
            self.join(f"dparams{node.index}", Kind.GRADIENT, node, {f"d{p}": s for p, s in node.params.items()})
            return tuple(f"d{p}" for p in node.params)
        return tuple(self.slot(f"d{p}", Kind.GRADIENT, shape) for p, shape in node.params.items())

    def params(self, node: Node) -> None:
        """The node's weights: its parameters (one slot ``params{i}`` where the node is joined)
        and its buffers (batch normalisation's running statistics)."""
        if node.index in self.joined:
            self.join(f"params{node.index}", Kind.WEIGHT, node, node.params)
        for name, shape in node.weights.items():
            if name not in self.members:
                self.slot(name, Kind.WEIGHT, shape)

    def join(self, name: str, kind: Kind, node: Node, members: dict) -> None:
        """A flat float32 slot ``name`` of ``members`` (name -> shape), one after another."""
        start = 0
        for member, shape in members.items():
            self.members[member] = (name, start, tuple(int(d) for d in shape))
            start += math.prod(shape)
        self.slot(name, kind, (start,))
        self.flats[name] = (node.index, tuple(members))

    def workspace(self, name: str, nelems: int) -> str:
        return self.slot(name, Kind.WORKSPACE, (nelems,))

    # -- backward -----------------------------------------------------------------------------------

    def backward(self, node: Node) -> None:
        """Ops that turn the gradient of the node's output into its parameters' gradients and
        contributions to the gradients of the inputs that need one: the node's dropout and
        activation first, then its op's (:meth:`~.layers.base.NodeOp.backward`)."""
        i = node.index
        g = self.grad[i]
        if node.dropout:
            mask = f"mask{i}"
            self.op(f"dropout{i}_backward", (mask, g), (g,),
                    lambda a, ctx, g=g: kernels.dropout_backward(a[mask], a[g], a[g]))
        act = ACTIVATIONS.get(node.activation)
        if act:
            saved = f"z{i}" if act.saves_input else f"h{i}"
            gz = self.slot(f"gz{i}", Kind.GRADIENT, self.slots[f"h{i}"].shape)
            self.op(f"{node.activation}{i}_backward", (saved, g), (gz,),
                    lambda a, ctx, g=g: act.backward(a[saved], a[g], a[gz]))
            g = gz
        dx = self.contribution(node.inputs[0])             # None: the input needs no gradient
        node.kind.backward(self, node, g, self.out[node.inputs[0]], dx)
        self.accumulate(node.inputs[:1])

    def contribution(self, j: int) -> str | None:
        """The slot a backward op writes node ``j``'s gradient contribution to: its gradient slot
        for the first contribution, else a temporary that :meth:`accumulate` adds in. None when
        ``j`` needs no gradient (the input, or a node no parameter depends on)."""
        if not self.needs[j]:
            return None
        shape = self.slots[self.out[j]].shape
        if j not in self.grad:
            self.grad[j] = self.slot(f"g{j}", Kind.GRADIENT, shape)
            return self.grad[j]
        self.temps += 1
        name = self.slot(f"g{j}.{self.temps}", Kind.GRADIENT, shape)
        self.pending.append((j, name))
        return name

    def accumulate(self, inputs) -> None:
        """Add every pending temporary contribution of ``inputs`` into their gradient slots."""
        for j, name in [p for p in self.pending if p[0] in inputs]:
            self.pending.remove((j, name))
            total = self.grad[j]
            self.op(f"accumulate_{total}", (total, name), (total,),
                    lambda a, ctx, total=total, name=name: ck.add_forward(a[total], a[name], a[total]))

    # -- optimizer ----------------------------------------------------------------------------------

    def optimizer(self) -> None:
        """One step per node's parameters (per parameter where the node's are apart), each over
        sub-groups of its state where one step would hold more than the largest op before it
        (Note [Optimizer steps in sub-groups])."""
        options = self.options
        lr, wd = options.learning_rate, options.weight_decay
        if options.optimizer == "adam":     # (op name, state slots' prefixes, flops per element, update)
            kind, names, flops = "adam", ("adam_m", "adam_v"), 12
            def update(param, grad, state, ctx):
                kernels.adam_update(param, grad, *state, lr, 0.9, 0.999, 1e-8, ctx.step, wd)
        else:
            kind, names, flops = "sgd", ("sgd_velocity",), 4
            def update(param, grad, state, ctx):
                kernels.sgd_update(param, grad, *state, lr, options.momentum, wd)
        passes = max((sum(self.slots[s].arena_nbytes for s in op.accesses) for op in self.ops), default=0)
        if self.floor_nbytes is not None:
            passes = min(passes, self.floor_nbytes)
        for node in self.net.nodes:
            params = {f"params{node.index}": self.slots[f"params{node.index}"].shape} \
                if node.index in self.joined else node.params
            for p, shape in params.items():
                grad = f"d{p}"
                groups = self.subgroups(p, grad, len(names), passes)
                for j, (lo, hi) in enumerate(groups):
                    part = None if len(groups) == 1 else (lo, hi)         # None: the whole step
                    tag = p if part is None else f"{p}.{j}"
                    state = tuple(self.slot(f"{name}_{tag}", Kind.OPTIMIZER_STATE,
                                            shape if part is None else (hi - lo,)) for name in names)
                    # read and written: its part of the parameter and the gradient, and its state
                    nbytes = None if part is None else 2 * 4 * (hi - lo) * (2 + len(state))
                    self.op(f"{kind}_{tag}", (p, grad, *state), (p, grad, *state),
                            lambda a, ctx, p=p, grad=grad, state=state, part=part: update(
                                _part(a[p], part), _part(a[grad], part), [a[s] for s in state], ctx),
                            flops=flops * (hi - lo), unit="optimizer", nbytes=nbytes)

    def subgroups(self, p: str, grad: str, states: int, floor_nbytes: int) -> list[tuple[int, int]]:
        """The (first, last + 1) elements of each sub-group of ``p``'s optimizer step, with
        ``states`` float32 state arrays of ``p``'s size: one group where the step's working set is
        at most ``floor_nbytes``, else the fewest (at most :data:`MAX_SUBGROUPS`) that bring every
        group's within it, or the most where none does; groups of whole arena units, the last the
        rest (Note [Optimizer steps in sub-groups])."""
        n = self.numel(p)
        held = self.slots[p].arena_nbytes + self.slots[grad].arena_nbytes
        groups = [(0, n)]
        if held + states * round_up(4 * n) <= floor_nbytes:
            return groups
        for k in range(2, MAX_SUBGROUPS + 1):
            size = -(-n // (k * UNIT_ELEMS)) * UNIT_ELEMS
            if size >= n:
                break                                 # too few elements to split further
            groups = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
            if held + states * round_up(4 * size) <= floor_nbytes:
                break
        return groups


def _part(array, part: tuple[int, int] | None):
    """``array`` whole, or the elements ``part`` (first, last + 1) of it flattened (a view: the
    arrays of an op are C-contiguous views of the arena, so the step writes the slot itself)."""
    if part is None:
        return array
    assert array.flags.c_contiguous, "a sub-group's step would update a copy"
    return array.reshape(-1)[part[0]:part[1]]
