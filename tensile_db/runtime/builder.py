"""The training program of a network: forward, loss, backward and optimizer steps over slots.

:func:`build_training_program` walks the network's nodes (:mod:`.network`) in execution order,
then backwards, and emits one :class:`~.program.Op` per kernel call. Branches are no special
case: a node's output slot lives until its last reader (the program's lifetimes follow from the
op order), and a node read by several others (a residual's input, a dense block's features)
collects its gradient from each: the first contribution writes the gradient slot, each later one
writes a temporary that an ``accumulate`` op adds in.

Slots, for node ``i``: ``h{i}`` its output (``d{i}`` after a dense layer's dropout, with the
mask ``mask{i}``), ``g{i}`` the gradient of the slot its readers read, ``gz{i}`` the gradient
before its in-place activation, ``ws{i}`` / ``wsb{i}`` the workspaces of its forward and backward
ops (a convolution's padded input, im2col matrix and product; a pool's padded input), ``am{i}``
a max pool's argmax, ``bm{i}`` / ``bs{i}`` batch normalisation's batch mean and inverse standard
deviation. Parameters, their gradients (``dW{i}`` ...) and optimizer state follow
:mod:`.network`'s names.

Recompute: batch normalisation's forward op also updates the running statistics, so re-running
it would update them twice; it carries a *replay* op that applies the saved batch statistics
instead (``batch_norm_apply``), which gives the forward pass's values bit for bit. Workspaces are
not inputs of a recipe: a replay allocates its own.
"""

from __future__ import annotations

import math

from . import conv_kernels as ck
from . import kernels
from .model import ModelSpec, TrainOptions
from .network import INPUT, Node, pool_workspace
from .program import Kind, Op, Program, Slot


def build_training_program(spec: ModelSpec, options: TrainOptions, batch: int) -> Program:
    """The training iteration of ``spec`` at batch size ``batch``: load the batch, forward, loss,
    backward, and one optimizer step per parameter (after the whole backward pass, as
    ``optimizer.step()`` in PyTorch).

    Activations run in place on their node's output (their backward needs only the output);
    dropout backward runs in place on the incoming gradient; activation backward writes a new
    gradient slot, since its kernels must not overwrite ``dy`` while reading it.
    """
    return _Builder(spec, options, batch).program()


class _Builder:
    def __init__(self, spec: ModelSpec, options: TrainOptions, batch: int):
        self.spec, self.options, self.batch = spec, options, batch
        self.net = spec.network
        self.slots: dict[str, Slot] = {}
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
           unit: str = "elementwise") -> None:
        self.ops.append(self.make_op(name, reads, writes, run, replay, flops, unit))

    def make_op(self, name: str, reads, writes, run, replay: Op | None = None, flops: int = 0,
                unit: str = "elementwise") -> Op:
        """An op costing ``flops`` (elementwise ops: one per element written, when 0) and the
        bytes of the slots it reads and writes, workspaces left out (:class:`Op`)."""
        moved = [self.slots[s] for s in tuple(reads) + tuple(writes) if self.slots[s].kind is not Kind.WORKSPACE]
        flops = flops or sum(self.numel(s) for s in writes if self.slots[s].kind is not Kind.WORKSPACE)
        return Op(name, tuple(reads), tuple(writes), run, replay, int(flops), sum(s.nbytes for s in moved), unit)

    def numel(self, slot: str) -> int:
        return math.prod(self.slots[slot].shape)

    def rows(self, shape) -> tuple[int, ...]:
        return (self.batch, *shape)

    # -- the whole iteration ----------------------------------------------------------------------

    def program(self) -> Program:
        spec, batch = self.spec, self.batch
        classification = spec.task == "classification"
        x = self.slot("x", Kind.INPUT, self.rows(self.net.input_shape))
        y = self.slot("y", Kind.INPUT, (batch,) if classification else (batch, spec.n_outputs),
                      "int32" if classification else "float32")

        def load(a, ctx):
            ctx.device.to_device(ctx.batch_x.reshape(a[x].shape), a[x])
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
        return Program(self.slots, self.ops)

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
        i, b = node.index, self.batch
        ins = [self.out[j] for j in node.inputs]
        inp = ins[0]
        h = self.slot(f"h{i}", Kind.ACTIVATION, self.rows(node.shape))
        if node.op == "dense":
            w, bias = f"W{i}", f"b{i}"
            self.params(node)
            self.op(f"dense{i}", (inp, w, bias), (h,),
                    lambda a, ctx: kernels.dense_forward(a[inp].reshape(b, -1), a[w], a[bias], a[h]),
                    flops=2 * b * self.numel(w), unit="matmul")
        elif node.op == "conv":
            g = node.geometry(b)
            self.params(node)
            w, bias = f"W{i}", f"b{i}" if f"b{i}" in node.params else None
            ws = self.workspace(f"ws{i}", node.workspace_nelems(b))
            self.op(f"conv{i}", (inp, w) + ((bias,) if bias else ()), (h, ws),
                    lambda a, ctx: ck.conv2d_forward_chunked(a[inp], a[w], a[bias] if bias else None, a[h], g,
                                                             a[ws]),
                    flops=self.conv_flops(h, w), unit="conv")
        elif node.op == "batch_norm":
            self.params(node)
            gamma, beta, rmean, rvar = f"gamma{i}", f"beta{i}", f"mean{i}", f"var{i}"
            c = node.shape[0]
            bm, bs = self.slot(f"bm{i}", Kind.ACTIVATION, (c,)), self.slot(f"bs{i}", Kind.ACTIVATION, (c,))
            momentum, eps = node.layer.momentum, node.layer.eps
            replay = self.make_op(f"batch_norm{i}_replay", (inp, gamma, beta, bm, bs), (h,),
                                  lambda a, ctx: ck.batch_norm_apply(a[inp], a[gamma], a[beta], a[bm], a[bs], a[h]),
                                  flops=2 * self.numel(h))
            self.op(f"batch_norm{i}", (inp, gamma, beta, rmean, rvar), (h, bm, bs, rmean, rvar),
                    lambda a, ctx: ck.batch_norm_forward(a[inp], a[gamma], a[beta], a[h], a[bm], a[bs], a[rmean],
                                                         a[rvar], momentum, eps), replay, flops=6 * self.numel(h))
        elif node.op == "max_pool":
            g = node.geometry(b)
            window = math.prod(g.kernel)
            am = self.slot(f"am{i}", Kind.ACTIVATION, self.rows(node.shape), "uint8" if window <= 256 else "int32")
            ws = self.workspace(f"ws{i}", node.workspace_nelems(b))
            self.op(f"max_pool{i}", (inp,), (h, am, ws),
                    lambda a, ctx: ck.max_pool_forward(a[inp], a[h], a[am], g, pool_workspace(g, a[ws])),
                    flops=window * self.numel(h))
        elif node.op == "avg_pool":
            g = node.geometry(b)
            ws = self.workspace(f"ws{i}", node.workspace_nelems(b))
            self.op(f"avg_pool{i}", (inp,), (h, ws),
                    lambda a, ctx: ck.avg_pool_forward(a[inp], a[h], g, pool_workspace(g, a[ws])),
                    flops=math.prod(g.kernel) * self.numel(h))
        elif node.op == "global_avg_pool":
            self.op(f"global_avg_pool{i}", (inp,), (h,), lambda a, ctx: ck.global_avg_pool_forward(a[inp], a[h]))
        elif node.op == "add":
            self.op(f"add{i}", tuple(ins), (h,), lambda a, ctx: ck.add_forward(a[ins[0]], a[ins[1]], a[h]))
        elif node.op == "concat":
            self.op(f"concat{i}", tuple(dict.fromkeys(ins)), (h,),
                    lambda a, ctx: ck.concat_forward([a[s] for s in ins], a[h]))
        elif node.op == "dropout":
            self.dropout(i, inp, h, node.dropout)
        else:                                               # flatten, or an activation node's copy
            self.op(f"{node.op}{i}", (inp,), (h,), lambda a, ctx: _copy_into(a[inp], a[h]))
        self.out[i] = h
        if node.activation != "none":
            fwd = kernels.ACTIVATIONS[node.activation][0]
            self.op(f"{node.activation}{i}", (h,), (h,), lambda a, ctx: fwd(a[h], a[h]))
        if node.op == "dense" and node.dropout:
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

    def params(self, node: Node) -> None:
        for name, shape in node.weights.items():
            self.slot(name, Kind.WEIGHT, shape)

    def conv_flops(self, out: str, w: str) -> int:
        """Multiply-adds of a convolution, times two: each output element (``out``: B, OC, OH,
        OW) takes a dot product over the kernel's ``C/g * KH * KW`` taps (``w``: OC, C/g, KH, KW)."""
        return 2 * self.numel(out) * math.prod(self.slots[w].shape[1:])

    def workspace(self, name: str, nelems: int) -> str:
        return self.slot(name, Kind.WORKSPACE, (nelems,))

    # -- backward -----------------------------------------------------------------------------------

    def backward(self, node: Node) -> None:
        """Ops that turn the gradient of the node's output into its parameters' gradients and
        contributions to the gradients of the inputs that need one: the dropout and activation
        of a layer first, then the layer's own (:data:`_BACKWARD`, by op; a copy for the rest)."""
        i = node.index
        g = self.grad[i]
        if node.op == "dense" and node.dropout:
            mask = f"mask{i}"
            self.op(f"dropout{i}_backward", (mask, g), (g,),
                    lambda a, ctx, g=g: kernels.dropout_backward(a[mask], a[g], a[g]))
        if node.activation != "none":
            bwd, h = kernels.ACTIVATIONS[node.activation][1], f"h{i}"
            gz = self.slot(f"gz{i}", Kind.GRADIENT, self.slots[h].shape)
            self.op(f"{node.activation}{i}_backward", (h, g), (gz,),
                    lambda a, ctx, g=g: bwd(a[h], a[g], a[gz]))
            g = gz
        dx = self.contribution(node.inputs[0])             # None: the input needs no gradient
        _BACKWARD.get(node.op, _Builder._copy_backward)(self, node, g, self.out[node.inputs[0]], dx)
        self.accumulate(node.inputs[:1])

    # Each op's backward: ``g`` the gradient of its output (after its activation's), ``inp`` its
    # first input's slot, ``dx`` where that input's gradient contribution goes (None: nowhere).

    def _dense_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        i, b = node.index, self.batch
        w, bias = f"W{i}", f"b{i}"
        dw, db = (self.slot(f"d{p}", Kind.GRADIENT, self.slots[p].shape) for p in (w, bias))
        self.op(f"dense{i}_backward", (inp, w, g), (dw, db) + ((dx,) if dx else ()),
                lambda a, ctx: kernels.dense_backward(a[inp].reshape(b, -1), a[w], a[g],
                                                      a[dx].reshape(b, -1) if dx else None, a[dw], a[db]),
                flops=2 * b * self.numel(w) * (1 + bool(dx)), unit="matmul")

    def _conv_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        i, b = node.index, self.batch
        geo = node.geometry(b)
        w, bias = f"W{i}", f"b{i}" if f"b{i}" in node.params else None
        dw = self.slot(f"dW{i}", Kind.GRADIENT, self.slots[w].shape)
        db = self.slot(f"db{i}", Kind.GRADIENT, self.slots[bias].shape) if bias else None
        ws = self.workspace(f"wsb{i}", node.workspace_nelems(b))
        self.op(f"conv{i}_backward", (inp, w, g), (dw,) + ((db,) if db else ()) + ((dx,) if dx else ()) + (ws,),
                lambda a, ctx: ck.conv2d_backward_chunked(a[inp], a[w], a[g], a[dx] if dx else None, a[dw],
                                                          a[db] if db else None, geo, a[ws]),
                flops=self.conv_flops(f"h{i}", w) * (1 + bool(dx)), unit="conv")

    def _batch_norm_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        i = node.index
        gamma, bm, bs = f"gamma{i}", f"bm{i}", f"bs{i}"
        dgamma = self.slot(f"dgamma{i}", Kind.GRADIENT, self.slots[gamma].shape)
        dbeta = self.slot(f"dbeta{i}", Kind.GRADIENT, self.slots[gamma].shape)
        self.op(f"batch_norm{i}_backward", (inp, gamma, bm, bs, g), (dgamma, dbeta) + ((dx,) if dx else ()),
                lambda a, ctx: ck.batch_norm_backward(a[inp], a[gamma], a[bm], a[bs], a[g],
                                                      a[dx] if dx else None, a[dgamma], a[dbeta]),
                flops=10 * self.numel(g))

    def _max_pool_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        i = node.index
        geo, am = node.geometry(self.batch), f"am{i}"
        ws = self.workspace(f"wsb{i}", node.workspace_nelems(self.batch))
        self.op(f"max_pool{i}_backward", (g, am), ((dx,) if dx else ()) + (ws,),
                lambda a, ctx: ck.max_pool_backward(a[g], a[am], a[dx], geo, pool_workspace(geo, a[ws])))

    def _avg_pool_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        i = node.index
        geo = node.geometry(self.batch)
        ws = self.workspace(f"wsb{i}", node.workspace_nelems(self.batch))
        self.op(f"avg_pool{i}_backward", (g,), ((dx,) if dx else ()) + (ws,),
                lambda a, ctx: ck.avg_pool_backward(a[g], a[dx], geo, pool_workspace(geo, a[ws])))

    def _global_avg_pool_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        self.op(f"global_avg_pool{node.index}_backward", (g,), (dx,) if dx else (),
                lambda a, ctx: ck.global_avg_pool_backward(a[g], a[dx]))

    def _dropout_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        mask = f"mask{node.index}"
        self.op(f"dropout{node.index}_backward", (mask, g), (dx,) if dx else (),
                lambda a, ctx: kernels.dropout_backward(a[mask], a[g], a[dx]))

    def _join_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        """``add`` (each input gets the gradient) and ``concat`` (each its channels of it)."""
        ins = [self.out[j] for j in node.inputs]
        targets = [dx] + [self.contribution(j) for j in node.inputs[1:]]
        kept = [(t, self.slots[s].shape) for t, s in zip(targets, ins)]
        writes = tuple(dict.fromkeys(t for t in targets if t))
        if node.op == "add":
            def run(a, ctx):
                for t in writes:
                    _copy_into(a[g], a[t])
        else:
            def run(a, ctx):
                start = 0
                for t, shape in kept:
                    if t:
                        a[t][...] = a[g][:, start:start + shape[1]]
                    start += shape[1]
        if writes:
            self.op(f"{node.op}{node.index}_backward", (g,), writes, run)
        self.accumulate(node.inputs[1:])

    def _copy_backward(self, node: Node, g: str, inp: str, dx: str | None) -> None:
        """flatten, or an activation node's copy."""
        self.op(f"{node.op}{node.index}_backward", (g,), (dx,) if dx else (), lambda a, ctx: _copy_into(a[g], a[dx]))

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
        options = self.options
        lr, wd = options.learning_rate, options.weight_decay
        for node in self.net.nodes:
            for p, shape in node.params.items():
                grad = f"d{p}"
                if options.optimizer == "adam":
                    m = self.slot(f"adam_m_{p}", Kind.OPTIMIZER_STATE, shape)
                    v = self.slot(f"adam_v_{p}", Kind.OPTIMIZER_STATE, shape)
                    self.op(f"adam_{p}", (p, grad, m, v), (p, grad, m, v),
                        lambda a, ctx, p=p, grad=grad, m=m, v=v: kernels.adam_update(
                            a[p], a[grad], a[m], a[v], lr, 0.9, 0.999, 1e-8, ctx.step, wd),
                        flops=12 * self.numel(p), unit="optimizer")
                else:
                    vel = self.slot(f"sgd_velocity_{p}", Kind.OPTIMIZER_STATE, shape)
                    self.op(f"sgd_{p}", (p, grad, vel), (p, grad, vel),
                        lambda a, ctx, p=p, grad=grad, vel=vel: kernels.sgd_update(
                            a[p], a[grad], a[vel], lr, options.momentum, wd),
                        flops=4 * self.numel(p), unit="optimizer")


#: Each op's backward in :class:`_Builder` (the others: a copy of the gradient).
_BACKWARD = {"dense": _Builder._dense_backward, "conv": _Builder._conv_backward,
             "batch_norm": _Builder._batch_norm_backward, "max_pool": _Builder._max_pool_backward,
             "avg_pool": _Builder._avg_pool_backward, "global_avg_pool": _Builder._global_avg_pool_backward,
             "dropout": _Builder._dropout_backward, "add": _Builder._join_backward, "concat": _Builder._join_backward}


def _copy_into(src, dst) -> None:
    """``dst[...] = src`` in ``dst``'s shape (flatten, and the gradients of a join)."""
    dst[...] = src.reshape(dst.shape)
