"""From the rows read for training to what the coordinator trains on: the task, the encoded
label, the held-out split (:func:`tensile_db.runtime.metrics.split_rows`) and the preprocessing
fitted on the training rows only (:func:`tensile_db.runtime.preprocess.fit`), so that no
statistic of a held-out row (a mean, a mode, a category's frequency) reaches the model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..errors import InvalidArgument
from ..runtime import metrics as heldout
from ..runtime import model as models
from ..runtime import preprocess
from .data import TrainingData, encode_labels


@dataclass
class Prepared:
    """task; classes: the class values in output order (None for regression); label_names: a
    text label's class names (else None); pre: the fitted preprocessing; x: network inputs
    (N, F) float32 before scaling, of the training rows, or with ``rows`` of every row read;
    x_test: the held-out rows' (None with ``rows``); y / y_test: the training and the held-out
    rows' class indices (N,) int32 or targets (N, 1) float32; rows / test_rows: where x holds
    every row, the training and the held-out rows' indices in it (int32 below 2**31 rows).

    Note [Rows sent as the scan wrote them]: where every input is a real column that refuses
    NULLs, the network's inputs are the scan's own row-major block of those columns
    (:meth:`~tensile_db.runtime.preprocess.Preprocessor.one_block`), in the scan's sealed memory
    file. Gathering the training and the held-out rows out of it cost 0.06 to 0.2 s for a million
    rows of 16 columns (a fresh 51 MB array's pages among it), and shipping them a copy more into
    the message's file; so the block goes to the coordinator as it lies, with the rows' indices
    (:meth:`arrays`), and the coordinator reads each batch's rows through them."""

    task: str
    classes: list[float] | None
    label_names: list[str] | None
    pre: preprocess.Preprocessor
    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray
    rows: np.ndarray | None = None
    test_rows: np.ndarray | None = None

    def arrays(self, by_index: bool = False) -> dict[str, np.ndarray]:
        """The arrays of a ``train`` or ``search`` request: with ``by_index`` (a coordinator that
        takes them, :meth:`~tensile_db.coordinator.client.CoordinatorClient.takes_rows`) and
        ``rows``, every row's inputs and the indices of the training and held-out ones in them;
        else each part's inputs, gathered here where ``rows`` is set."""
        held = len(self.y_test) > 0
        if self.rows is None:
            return {"x": self.x, "y": self.y, **({"x_test": self.x_test, "y_test": self.y_test} if held else {})}
        if by_index:
            return {"x": self.x, "rows": self.rows, "y": self.y,
                    **({"test_rows": self.test_rows, "y_test": self.y_test} if held else {})}
        return {"x": np.take(self.x, self.rows, axis=0), "y": self.y,
                **({"x_test": np.take(self.x, self.test_rows, axis=0), "y_test": self.y_test} if held else {})}

    def header(self) -> dict:
        """The header fields of a ``train`` or ``search`` request besides the model's."""
        return {"task": self.task, "n_outputs": len(self.classes) if self.classes else 1,
                "scale": self.pre.scale_modes(),
                "classes": self.label_names or ([heldout.class_text(c) for c in self.classes] if self.classes else None)}


def prepare(data: TrainingData, opts: models.TrainOptions, check=lambda task, n_outputs, pre, rows: None) -> Prepared:
    """Split ``data`` and fit its preprocessing under ``opts``. ``check(task, n_outputs, pre,
    rows)`` runs after the fit and before the inputs are built, so that a model too large for the
    limits (a one-hot encoding of many categories) is refused before anything is allocated for it.
    Raises InvalidArgument (a label that does not suit the task, too few rows to hold out
    ``test_size``, a preprocessing rule that does not suit its column, a missing value that is not
    imputed) and what ``check`` raises."""
    task = opts.task or ("classification" if data.label_kind == "categorical" or data.label_is_integer
                         else "regression")
    if task == "regression" and opts.test_sampling == "stratified":
        raise InvalidArgument(f'options.test_sampling "stratified" needs classes, but label column "{data.label}" is '
                              'a regression target; use "random" or "last", or options.task "classification"')
    y, classes, label_names = encode_labels(data, task)
    train, test = heldout.split_rows(len(y), opts.test_size, opts.sampling(task), opts.seed,
                                     y if task == "classification" else None)
    pre = preprocess.fit(data.raw, data.kinds, train, opts, data.array_width)
    check(task, len(classes) if classes else 1, pre, len(y))
    block = pre.one_block(data.raw, data.finite)
    if block is not None:                   # Note [Rows sent as the scan wrote them]
        index = np.int32 if len(block) < 2 ** 31 else np.int64
        return Prepared(task, classes, label_names, pre, block, y[train], None, y[test], train.astype(index),
                        test.astype(index))
    x = pre.transform(data.raw, train, data.finite)
    # A held-out row may hold a category no training row has: it is "other" to the model.
    x_test = replace(pre, unseen="other").transform(data.raw, test, data.finite)
    return Prepared(task, classes, label_names, pre, x, y[train], x_test, y[test])
