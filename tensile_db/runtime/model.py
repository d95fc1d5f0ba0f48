"""Model descriptions: the architecture and training options a user writes as JSON, validated.

An architecture is ``{"layers": [{"dense": 256, "activation": "relu", "dropout": 0.1}, ...]}``:
hidden dense layers, each with an optional activation (``relu``, ``tanh``, ``sigmoid`` or
``none``; default ``relu``) and an optional dropout probability in [0, 1). The output layer is
added from the task: ``C`` logits with softmax cross-entropy for classification over ``C``
classes, one linear output with mean squared error for regression.

Every validation error names the offending key and value and says what is allowed.

Weights are float32 arrays named ``W{i}`` (I, O) and ``b{i}`` (O,) for dense layer ``i`` counted
from 0 (the output layer is the last), plus the feature standardisation ``x_mean`` / ``x_std``
(F,) and, for regression, ``y_mean`` / ``y_std`` (1,); :mod:`.weights` stores and checks them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import InvalidArgument
from . import kernels

TASKS = ("classification", "regression")
OPTIMIZERS = ("adam", "sgd")
ACTIVATIONS = ("relu", "tanh", "sigmoid", "none")
#: Largest width of one dense layer; wider is almost certainly a typo.
MAX_WIDTH = 1 << 16
#: Largest magnitude of a float32; options and labels beyond it cannot be computed with.
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Layer:
    """One hidden dense layer: ``units`` outputs, an activation, a dropout probability."""

    units: int
    activation: str = "relu"
    dropout: float = 0.0


@dataclass(frozen=True)
class Architecture:
    """Hidden layers of an MLP; the output layer is implied by the task."""

    layers: tuple[Layer, ...]

    def to_json(self) -> dict:
        return {"layers": [{"dense": l.units, "activation": l.activation, **({"dropout": l.dropout} if l.dropout else {})}
                           for l in self.layers]}


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
    replace: bool = False            # replace an existing model of the same name
    skip_nulls: bool = False         # drop rows with a NULL feature or label instead of failing

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

    def dense_shapes(self) -> list[tuple[int, int]]:
        """``(I, O)`` of every dense layer, output layer last."""
        widths = [self.n_features] + [l.units for l in self.architecture.layers] + [self.n_outputs]
        return list(zip(widths[:-1], widths[1:]))

    def n_parameters(self) -> int:
        return sum(i * o + o for i, o in self.dense_shapes())

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
        return cls(parse_architecture(architecture), n_features, n_outputs, task)


@dataclass(frozen=True)
class Limits:
    """The largest model the coordinator builds, set by the administrator in the server's
    configuration (``tensile.max_layers``, ``tensile.max_parameters``, ``tensile.max_job_bytes``).
    A training program has a fixed number of ops per dense layer, so ``max_layers`` bounds the ops
    per iteration too (and with it the time to build a program and the length of the period the
    jobs share). ``max_job_nbytes`` bounds what one training job may hold on the device and the
    host together, its unscheduled peak: what the budget does not hold is swapped to host memory,
    so without it a job within the other limits (wide layers at a large batch) could make the
    coordinator hold tens of gigabytes."""

    max_layers: int = 1000              # dense layers, the output layer included
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
        layers = len(spec.architecture.layers) + 1
        if layers > self.max_layers:
            raise InvalidArgument(f"model {name!r} has {layers:,} dense layers (with the output layer), more than "
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


def check_keys(obj: dict, allowed, where: str) -> None:
    """Raise InvalidArgument for the first key of ``obj`` not in ``allowed``, listing those."""
    for key in obj:
        if key not in allowed:
            raise InvalidArgument(f"{where}: unknown key {key!r}; allowed keys: {', '.join(allowed)}")


def parse_architecture(value) -> Architecture:
    """Validate an architecture (JSON text or dict). Raises InvalidArgument naming the key."""
    obj = load_json_object(value, "architecture")
    check_keys(obj, ("layers",), "architecture")
    layers = obj.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidArgument('architecture: "layers" must be a non-empty array of layers, '
                              'e.g. {"layers":[{"dense":128,"activation":"relu"}]}')
    parsed = []
    for i, layer in enumerate(layers):
        where = f"architecture.layers[{i}]"
        if not isinstance(layer, dict):
            raise InvalidArgument(f"{where} must be an object like {{\"dense\": 128}}, got {layer!r}")
        check_keys(layer, ("dense", "activation", "dropout"), where)
        units = layer.get("dense")
        if not isinstance(units, int) or isinstance(units, bool) or not 0 < units <= MAX_WIDTH:
            raise InvalidArgument(f'{where}."dense" must be an integer from 1 to {MAX_WIDTH}, got {units!r}')
        activation = layer.get("activation", "relu")
        if activation not in ACTIVATIONS:
            raise InvalidArgument(f'{where}."activation" must be one of {", ".join(ACTIVATIONS)}, got {activation!r}')
        dropout = layer.get("dropout", 0.0)
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise InvalidArgument(f'{where}."dropout" must be a number in [0, 1), got {dropout!r}')
        parsed.append(Layer(units, activation, float(dropout)))
    return Architecture(tuple(parsed))


def _shown(value) -> str:
    """A JSON value as the user wrote it, cut to a readable length."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_float32(key: str, value) -> float:
    """``value`` as a float, or InvalidArgument naming ``key`` when it is not finite or beyond
    float32's range (about 3.4e38), where the device computes."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and abs(number) <= FLOAT32_MAX):
        raise InvalidArgument(f"{key} is {_shown(value)}, beyond the range of real (float32, about 3.4e38); "
                              "pass a finite value of a sensible size")
    return number


_OPTION_TYPES = {
    "task": (str, type(None)), "epochs": int, "batch_size": int, "optimizer": str,
    "lr": (int, float, type(None)), "momentum": (int, float), "weight_decay": (int, float),
    "seed": int, "standardize": bool, "replace": bool, "skip_nulls": bool,
}


def parse_options(value) -> TrainOptions:
    """Validate training options (JSON text or dict). Raises InvalidArgument naming the key."""
    obj = dict(load_json_object(value, "options"))
    check_keys(obj, tuple(_OPTION_TYPES), "options")
    for key, val in obj.items():
        types = _OPTION_TYPES[key]
        if not isinstance(val, types) or (isinstance(val, bool) and types is not bool):
            raise InvalidArgument(f"options.{key} has the wrong type: got {_shown(val)}")
        if key in ("lr", "momentum", "weight_decay") and val is not None:
            obj[key] = check_float32(f"options.{key}", val)
    opts = TrainOptions(**obj)
    if opts.task is not None and opts.task not in TASKS:
        raise InvalidArgument(f"options.task must be one of {', '.join(TASKS)}, got {opts.task!r}")
    if opts.optimizer not in OPTIMIZERS:
        raise InvalidArgument(f"options.optimizer must be one of {', '.join(OPTIMIZERS)}, got {opts.optimizer!r}")
    if not 1 <= opts.epochs <= 100_000:
        raise InvalidArgument(f"options.epochs must be from 1 to 100000, got {_shown(opts.epochs)}")
    if not 1 <= opts.batch_size <= 1 << 20:
        raise InvalidArgument(f"options.batch_size must be from 1 to {1 << 20}, got {_shown(opts.batch_size)}")
    if not 0 <= opts.seed < 1 << 63:
        raise InvalidArgument(f"options.seed must be an integer from 0 to 2^63 - 1, got {_shown(opts.seed)}")
    if opts.lr is not None and not (math.isfinite(opts.lr) and opts.lr > 0):
        raise InvalidArgument(f"options.lr must be a positive number, got {opts.lr}")
    if not 0 <= opts.momentum < 1:
        raise InvalidArgument(f"options.momentum must be in [0, 1), got {opts.momentum}")
    if not (math.isfinite(opts.weight_decay) and opts.weight_decay >= 0):
        raise InvalidArgument(f"options.weight_decay must be a non-negative number, got {opts.weight_decay}")
    return opts


# --- weights ------------------------------------------------------------------------------------


def init_weights(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """He-uniform (relu) or Glorot-uniform (others) float32 weights, zero biases."""
    rng = np.random.default_rng(seed)
    acts = activations(spec)
    weights = {}
    for i, ((fan_in, fan_out), act) in enumerate(zip(spec.dense_shapes(), acts)):
        limit = math.sqrt(6.0 / fan_in) if act == "relu" else math.sqrt(6.0 / (fan_in + fan_out))
        weights[f"W{i}"] = rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)
        weights[f"b{i}"] = np.zeros(fan_out, dtype=np.float32)
    return weights


def activations(spec: ModelSpec) -> list[str]:
    """The activation after each dense layer, output layer (``none``) last."""
    return [l.activation for l in spec.architecture.layers] + ["none"]


def standardize(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Raw features x (N, F) -> the network's float32 input (N, F): the stored feature scaling
    applied, if the model has one."""
    x = np.asarray(x, dtype=np.float32)
    return (x - weights["x_mean"]) / weights["x_std"] if "x_mean" in weights else x


def dense_layer(h, w, b, activation: str, out) -> None:
    """One dense layer into ``out``: ``activation(h @ w + b)``. h: (B, I), w: (I, O), b: (O,),
    out: (B, O), float32 arrays of one array module (NumPy or CuPy)."""
    kernels.dense_forward(h, w, b, out)
    if activation != "none":
        kernels.ACTIVATIONS[activation][0](out, out)


def finish(spec: ModelSpec, weights: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """The last layer's output (N, n_outputs) float32 -> class probabilities (softmax) for
    classification, values in the label's units (standardisation undone) for regression."""
    if spec.task == "classification":
        h = h - h.max(axis=1, keepdims=True)
        np.exp(h, out=h)
        h /= h.sum(axis=1, keepdims=True)
    elif "y_mean" in weights:
        h = h * weights["y_std"] + weights["y_mean"]
    return h


def forward(spec: ModelSpec, weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Inference on the host: raw features x (N, F) float32 -> outputs (N, n_outputs) float32.

    Classification outputs are class probabilities (softmax); regression outputs are in the
    label's units (standardisation undone). Dropout is the identity at inference. The
    coordinator's demand-layered inference (:mod:`tensile_db.inference`) runs the same steps.
    """
    h = standardize(weights, x)
    for i, act in enumerate(activations(spec)):
        w = weights[f"W{i}"]
        out = np.empty((h.shape[0], w.shape[1]), dtype=np.float32)
        dense_layer(h, w, weights[f"b{i}"], act, out)
        h = out
    return finish(spec, weights, h)
