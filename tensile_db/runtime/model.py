"""Model descriptions: the architecture and training options a user writes as JSON, validated.

An architecture is ``{"input": {"shape": [C, H, W]}, "layers": [...]}``: the shape of one row
(optional; default: a vector of the feature columns) and a list of layers — dense,
convolution, batch normalisation, pooling, flatten, activation, dropout, and the blocks
``residual`` and ``concat`` (:mod:`.network` parses them and builds the graph). Or it names a
published network, ``{"model": "resnet50", "width": 0.25, "input": {"shape": [3, 32, 32]}}``
(:mod:`.zoo`). The output layer is added from the task: ``C`` logits with softmax cross-entropy
for classification over ``C`` classes, one linear output with mean squared error for regression.

Every validation error names the offending key and value and says what is allowed.

Weights are float32 arrays named after the network's nodes (:mod:`.network`: ``W{i}`` and
``b{i}`` of dense layers and convolutions, ``gamma{i}`` / ``beta{i}`` / ``mean{i}`` / ``var{i}``
of batch normalisation), plus the feature standardisation ``x_mean`` / ``x_std`` (F,) and, for
regression, ``y_mean`` / ``y_std`` (1,); :mod:`.weights` stores and checks them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cached_property, partial

import numpy as np

from ..errors import InvalidArgument
from . import fused, kernels, preprocess, search
from . import network as networks
from .checks import check_keys, shown
from .network import MAX_WIDTH, Layer  # noqa: F401  (re-exported: the MLP's layer, its width limit)

TASKS = ("classification", "regression")
OPTIMIZERS = ("adam", "sgd")
#: Largest magnitude of a float32; options and labels beyond it cannot be computed with.
FLOAT32_MAX = float(np.finfo(np.float32).max)


#: Largest side of an input shape, and largest number of values in one row.
MAX_INPUT_SIDE = 1 << 16
MAX_INPUT_VALUES = 1 << 24


@dataclass(frozen=True)
class Architecture:
    """The layers of a network (:mod:`.network`'s layer objects; the output layer is implied by
    the task), the shape of one row (None: a vector of the feature columns), and, for a named
    network, its name and options as the user wrote them."""

    layers: tuple
    input_shape: tuple[int, ...] | None = None
    model: str | None = None
    model_options: tuple = ()

    def to_json(self) -> dict:
        shape = {"input": {"shape": list(self.input_shape)}} if self.input_shape else {}
        if self.model:
            return {"model": self.model, **dict(self.model_options), **shape}
        return {**shape, "layers": networks.layers_to_json(self.layers)}

    @property
    def n_features(self) -> int | None:
        """Values per row the input shape asks for (None: as many as the data has)."""
        return math.prod(self.input_shape) if self.input_shape else None


@dataclass(frozen=True)
class TrainOptions:
    """Training options; the field names are the JSON keys users write."""

    task: str | None = None          # None: inferred from the label column's type
    epochs: int = 10
    batch_size: int = 128
    optimizer: str = "adam"
    lr: float | None = None          # None: 0.001 for adam, 0.01 for sgd
    momentum: float = 0.9            # sgd only
    weight_decay: float = 0.0
    seed: int = 0
    standardize: bool = True         # scale features (and regression targets) to mean 0, std 1
    replace: bool = False            # delete every earlier version of the model first
    skip_nulls: bool = False         # drop rows with a NULL feature or label instead of failing
    test_size: float = 0.2           # fraction of the rows held out for evaluation; 0: none
    test_sampling: str | None = None  # random | stratified | last; None: stratified (classification), random
    patience: int | None = None      # stop after this many epochs without a better held-out loss; None: never
    deploy: str = "auto"             # auto (if at least as good as the deployed version) | always | never
    # Preprocessing defaults for every feature column (per column: ``preprocess``; see
    # :mod:`.preprocess`). ``impute`` is a name of IMPUTE or {"constant": value}.
    impute: object = "error"
    encode: str = "one_hot"          # categorical columns: one_hot | ordinal
    scale: str | None = None         # numeric columns: standardize | minmax | none; None: standardize
    max_categories: int = 100        # one-hot columns per categorical column; the rarer ones are "other"
    unseen: str = "other"            # a category never seen in training, at prediction: other | error
    preprocess: dict | None = None   # column -> {"impute", "encode", "scale"} overriding the defaults
    search: dict | None = None       # hyperparameter search (:mod:`.search`); None: one model

    def sampling(self, task: str) -> str:
        """The held-out sampling in effect for ``task``: ``test_sampling``, or stratified for
        classification and random for regression."""
        return self.test_sampling or ("stratified" if task == "classification" else "random")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (0.001 if self.optimizer == "adam" else 0.01)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build the network: architecture, input width, output width, task."""

    architecture: Architecture
    n_features: int
    n_outputs: int
    task: str

    @cached_property
    def network(self) -> networks.Network:
        """The graph of the model's layers (:func:`.network.build_network`). Raises
        InvalidArgument when a layer does not suit its input."""
        return networks.build_network(self.architecture.layers, self.architecture.input_shape, self.n_features,
                                      self.n_outputs)

    def n_parameters(self) -> int:
        return self.network.n_parameters()

    @classmethod
    def of_row(cls, architecture, feature_names, n_outputs: int, task: str, n_inputs: int | None = None) -> "ModelSpec":
        """The spec of a registry row: its architecture (JSON text or a dict), its feature
        columns, its outputs and task, and its network inputs per row (``n_inputs``, from its
        preprocessing, :attr:`.preprocess.Preprocessor.width`). Without ``n_inputs``, the values
        per row are the input shape's when the architecture gives one (a model trained on one
        array column stores that column's name once), else one per feature column. Raises
        InvalidArgument as :meth:`parse`."""
        arch = parse_architecture(architecture)
        return cls.parse(arch, arch.n_features or n_inputs or len(feature_names), n_outputs, task)

    @classmethod
    def parse(cls, architecture, n_features: int, n_outputs: int, task: str) -> "ModelSpec":
        """The spec of a model stored or sent as JSON: ``architecture`` as text or a dict (see
        :func:`parse_architecture`), the input and output widths, the task (one of TASKS). The one
        place a spec is built from a registry row or a request. Raises InvalidArgument."""
        if task not in TASKS:
            raise InvalidArgument(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        n_features, n_outputs = int(n_features), int(n_outputs)
        if n_features < 1 or n_outputs < 1:
            raise InvalidArgument(f"a model needs at least one feature and one output, got {n_features} and {n_outputs}")
        arch = architecture if isinstance(architecture, Architecture) else parse_architecture(architecture)
        spec = cls(arch, n_features, n_outputs, task)
        spec.network                              # noqa: B018  (shapes checked here)
        return spec


@dataclass(frozen=True)
class Limits:
    """The largest model the coordinator builds, set by the administrator in the server's
    configuration (``tensile.max_layers``, ``tensile.max_parameters``, ``tensile.max_job_bytes``).
    A training program has a bounded number of ops per layer, so ``max_layers`` bounds the ops
    per iteration too (and with it the time to build a program and the length of the period the
    jobs share). ``max_job_nbytes`` bounds what one training job may hold on the device and the
    host together, its unscheduled peak: what the budget does not hold is swapped to host memory,
    so without it a job within the other limits (wide layers at a large batch) could make the
    coordinator hold tens of gigabytes."""

    max_layers: int = 1000              # nodes of the network (layers, block joins), the output layer included
    max_parameters: int = 100_000_000   # weights and biases, elements (float32: 400 MB)
    max_job_nbytes: int = 4 << 30       # a training job's unscheduled peak, bytes

    def check_job(self, peak_nbytes: int, batch: int, name: str) -> None:
        """Raise InvalidArgument when a training job of model ``name`` at ``batch`` rows would
        hold more than ``max_job_nbytes`` (``peak_nbytes``: its unscheduled peak)."""
        if peak_nbytes > self.max_job_nbytes:
            raise InvalidArgument(f"training model {name!r} at batch {batch:,} needs {peak_nbytes:,} bytes of device "
                                  f"and host memory, more than tensile.max_job_bytes ({self.max_job_nbytes:,}); "
                                  "lower options.batch_size or the layer widths, or ask the administrator to raise "
                                  "tensile.max_job_bytes")

    def check(self, spec: ModelSpec, name: str) -> None:
        """Raise InvalidArgument naming the model, its size and the setting it exceeds."""
        layers = len(spec.network.nodes)
        if layers > self.max_layers:
            raise InvalidArgument(f"model {name!r} has {layers:,} layers (with the output layer), more than "
                                  f"tensile.max_layers ({self.max_layers:,}); use fewer layers, or ask the "
                                  "administrator to raise tensile.max_layers")
        parameters = spec.n_parameters()
        if parameters > self.max_parameters:
            raise InvalidArgument(f"model {name!r} has {parameters:,} parameters, more than tensile.max_parameters "
                                  f"({self.max_parameters:,}); use narrower or fewer layers, or ask the "
                                  "administrator to raise tensile.max_parameters")


# --- parsing ------------------------------------------------------------------------------------


def load_json_object(value, what: str) -> dict:
    """A JSON object given as text, bytes or a dict (None: empty). Raises InvalidArgument naming
    ``what`` for invalid JSON or another JSON type."""
    if value is None:
        return {}
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value) if value else {}
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def parse_architecture(value) -> Architecture:
    """Validate an architecture (JSON text or dict): ``layers`` (see :func:`.network.parse_layers`)
    or ``model`` with its options (:mod:`.zoo`), and an optional ``input`` shape. Raises
    InvalidArgument naming the key."""
    from . import zoo

    obj = load_json_object(value, "architecture")
    named = "model" in obj
    check_keys(obj, ("model", "input") + zoo.OPTION_KEYS if named else ("input", "layers"), "architecture")
    input_shape = _input_shape(obj["input"]) if "input" in obj else None
    if named:
        default_shape, layers = zoo.expand(obj["model"], {k: v for k, v in obj.items() if k in zoo.OPTION_KEYS})
        options = tuple((k, obj[k]) for k in zoo.OPTION_KEYS if k in obj)
        return Architecture(networks.parse_layers(layers, f"architecture (model {obj['model']})"),
                            input_shape or tuple(default_shape), obj["model"], options)
    layers = obj.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidArgument('architecture: "layers" must be a non-empty array of layers, '
                              'e.g. {"layers":[{"dense":128,"activation":"relu"}]}')
    return Architecture(networks.parse_layers(layers, "architecture.layers"), input_shape)


def preprocessor_of_row(record, feature_names: list[str], architecture) -> preprocess.Preprocessor:
    """The preprocessing of a registry row: its ``preprocess`` record (JSON text, a dict, or
    None for a model stored without one), its feature columns and its architecture (JSON text or
    a dict; its input shape gives an array column's width). Raises InvalidArgument for a record
    that does not fit."""
    if isinstance(record, str):
        record = json.loads(record)
    n_values = parse_architecture(architecture).n_features
    return preprocess.Preprocessor.from_json(record, list(feature_names), n_values or len(feature_names))


def _input_shape(value) -> tuple[int, ...]:
    shape = value.get("shape") if isinstance(value, dict) and set(value) == {"shape"} else None
    if (not isinstance(shape, list) or len(shape) not in (1, 3)
            or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_INPUT_SIDE for d in shape)
            or math.prod(shape) > MAX_INPUT_VALUES):
        raise InvalidArgument(f'architecture."input" must be {{"shape": [C, H, W]}} (an image) or {{"shape": [F]}}, '
                              f"sides from 1 to {MAX_INPUT_SIDE} and at most {MAX_INPUT_VALUES:,} values, got "
                              f"{shown(value)}")
    return tuple(shape)


def check_float32(key: str, value) -> float:
    """``value`` as a float, or InvalidArgument naming ``key`` when it is not finite or beyond
    float32's range (about 3.4e38), where the device computes."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and abs(number) <= FLOAT32_MAX):
        raise InvalidArgument(f"{key} is {shown(value)}, beyond the range of real (float32, about 3.4e38); "
                              "pass a finite value of a sensible size")
    return number


_OPTION_TYPES = {
    "task": (str, type(None)), "epochs": int, "batch_size": int, "optimizer": str,
    "lr": (int, float, type(None)), "momentum": (int, float), "weight_decay": (int, float),
    "seed": int, "standardize": bool, "replace": bool, "skip_nulls": bool,
    "test_size": (int, float), "test_sampling": (str, type(None)), "patience": (int, type(None)),
    "deploy": str, "impute": (str, dict, int, float), "encode": str, "scale": (str, type(None)),
    "max_categories": int, "unseen": str, "preprocess": (dict, type(None)), "search": (dict, type(None)),
}
TEST_SAMPLINGS = ("random", "stratified", "last")
DEPLOY_MODES = ("auto", "always", "never")
#: Largest fraction of the rows held out.
MAX_TEST_SIZE = 0.9
#: Most one-hot columns one categorical column may have.
MAX_CATEGORIES = 1000


def parse_options(value) -> TrainOptions:
    """Validate training options (JSON text or dict). Raises InvalidArgument naming the key."""
    opts = TrainOptions(**_typed_options(value))
    _check_choices(opts)
    _check_numbers(opts)
    _check_held_out(opts)
    preprocess.check_options(opts)         # validated where they are defined
    if opts.search is not None and search.parse(opts.search).halving and opts.test_size == 0:
        raise InvalidArgument("options.search.halving compares held-out losses, but options.test_size is 0; hold "
                              "out rows (test_size 0.2) or leave halving out")
    return opts


def _typed_options(value) -> dict:
    """The options object, each key known and each value of its type (floats checked as float32)."""
    obj = dict(load_json_object(value, "options"))
    check_keys(obj, tuple(_OPTION_TYPES), "options")
    for key, val in obj.items():
        types = _OPTION_TYPES[key]
        if not isinstance(val, types) or (isinstance(val, bool) and types is not bool):
            raise InvalidArgument(f"options.{key} has the wrong type: got {shown(val)}")
        if key in ("lr", "momentum", "weight_decay") and val is not None:
            obj[key] = check_float32(f"options.{key}", val)
    return obj


def _check_choices(opts: TrainOptions) -> None:
    if opts.task is not None and opts.task not in TASKS:
        raise InvalidArgument(f"options.task must be one of {', '.join(TASKS)}, got {opts.task!r}")
    if opts.optimizer not in OPTIMIZERS:
        raise InvalidArgument(f"options.optimizer must be one of {', '.join(OPTIMIZERS)}, got {opts.optimizer!r}")
    _check_choice("test_sampling", opts.test_sampling, TEST_SAMPLINGS, none_ok=True)
    _check_choice("deploy", opts.deploy, DEPLOY_MODES)


def _check_numbers(opts: TrainOptions) -> None:
    if not 1 <= opts.epochs <= 100_000:
        raise InvalidArgument(f"options.epochs must be from 1 to 100000, got {shown(opts.epochs)}")
    if not 1 <= opts.batch_size <= 1 << 20:
        raise InvalidArgument(f"options.batch_size must be from 1 to {1 << 20}, got {shown(opts.batch_size)}")
    if not 0 <= opts.seed < 1 << 63:
        raise InvalidArgument(f"options.seed must be an integer from 0 to 2^63 - 1, got {shown(opts.seed)}")
    if opts.lr is not None and not (math.isfinite(opts.lr) and opts.lr > 0):
        raise InvalidArgument(f"options.lr must be a positive number, got {opts.lr}")
    if not 0 <= opts.momentum < 1:
        raise InvalidArgument(f"options.momentum must be in [0, 1), got {opts.momentum}")
    if not (math.isfinite(opts.weight_decay) and opts.weight_decay >= 0):
        raise InvalidArgument(f"options.weight_decay must be a non-negative number, got {opts.weight_decay}")
    if not 1 <= opts.max_categories <= MAX_CATEGORIES:
        raise InvalidArgument(f"options.max_categories must be from 1 to {MAX_CATEGORIES}, got "
                              f"{shown(opts.max_categories)}")


def _check_held_out(opts: TrainOptions) -> None:
    """The held-out rows' options, and patience, which needs held-out rows."""
    if not 0 <= opts.test_size <= MAX_TEST_SIZE:
        raise InvalidArgument(f"options.test_size must be from 0 (no held-out rows) to {MAX_TEST_SIZE}, "
                              f"got {shown(opts.test_size)}")
    if opts.test_sampling == "stratified" and opts.task == "regression":
        raise InvalidArgument('options.test_sampling "stratified" needs classes; use "random" or "last" for '
                              "regression")
    if opts.patience is not None and not 1 <= opts.patience <= 100_000:
        raise InvalidArgument(f"options.patience must be from 1 to 100000 epochs (or null), got {shown(opts.patience)}")
    if opts.patience is not None and opts.test_size == 0:
        raise InvalidArgument("options.patience stops on the held-out loss, but options.test_size is 0; "
                              "hold out rows (test_size 0.2) or leave patience out")


def _check_choice(key: str, value, allowed, none_ok: bool = False) -> None:
    if not (value in allowed or (none_ok and value is None)):
        raise InvalidArgument(f"options.{key} must be one of {', '.join(allowed)}, got {shown(value)}")


# --- weights ------------------------------------------------------------------------------------


def init_weights(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """The network's initial float32 weights (:meth:`.network.Network.init_weights`)."""
    return spec.network.init_weights(seed)


def standardize(weights: dict[str, np.ndarray], x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Raw features x (N, F) -> the network's float32 input (N, F): the stored feature scaling
    applied, if the model has one, into ``out`` (N, F) float32 if given (else a new array)."""
    x = np.asarray(x, dtype=np.float32)
    if "x_mean" not in weights:
        return x
    if out is None:
        out = np.empty(x.shape, np.float32)
    if fused.scale_rows(x, weights["x_mean"], weights["x_std"], out):     # one pass: NumPy takes a call a row
        return out
    out = np.subtract(x, weights["x_mean"], out=out, dtype=np.float32)     # divided in place
    out /= weights["x_std"]
    return out


def finish(spec: ModelSpec, weights: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """The last layer's output (N, n_outputs) float32 -> class probabilities (softmax) for
    classification, values in the label's units (standardisation undone) for regression."""
    if spec.task == "classification":       # over the short axis as the training loss does it
        xp = kernels.array_module(h)
        rows = xp.empty((len(h), 1), h.dtype)
        kernels.row_max(h, rows)
        out = xp.empty_like(h)
        kernels.by_row(xp.subtract, h, rows, out)
        xp.exp(out, out=out)
        kernels.row_sums(out, rows)
        kernels.by_row(xp.divide, out, rows, out)
        return out
    if "y_mean" in weights:
        return h * weights["y_std"] + weights["y_mean"]
    return h


def forward(spec: ModelSpec, weights, x: np.ndarray, chunk_rows: int = 256) -> np.ndarray:
    """Inference on the host: raw features x (N, F) float32 -> outputs (N, n_outputs) float32,
    ``chunk_rows`` rows at a time; ``weights`` maps each array's name to it.

    Classification outputs are class probabilities (softmax); regression outputs are in the
    label's units (standardisation undone). Batch normalisation uses its running statistics and
    dropout is the identity. The coordinator's demand-layered inference
    (:mod:`tensile_db.inference`) runs the same nodes (:func:`.network.evaluate`). The scaling
    is applied chunk by chunk: no scaled copy of x is made.
    """
    return finish(spec, weights, spec.network.forward(weights, x, chunk_rows, partial(standardize, weights)))
