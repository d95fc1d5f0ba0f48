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
    text label's class names (else None); pre: the fitted preprocessing; x / x_test: network
    inputs (N, F) float32 of the training and held-out rows, before scaling; y / y_test: class
    indices (N,) int32 or targets (N, 1) float32."""

    task: str
    classes: list[float] | None
    label_names: list[str] | None
    pre: preprocess.Preprocessor
    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays of a ``train`` or ``search`` request."""
        held = {"x_test": self.x_test, "y_test": self.y_test} if len(self.x_test) else {}
        return {"x": self.x, "y": self.y, **held}

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
    x = pre.transform(data.raw, train, data.finite)
    # A held-out row may hold a category no training row has: it is "other" to the model.
    x_test = replace(pre, unseen="other").transform(data.raw, test, data.finite)
    return Prepared(task, classes, label_names, pre, x, y[train], x_test, y[test])
