"""Named architectures: published convolutional networks a user asks for by name instead of
writing their layers.

This module owns the layer structures of the named models and their options; it produces the
same architecture JSON a user could write by hand (a list of layer objects, per-row input
shape ``[C, H, W]``), which the network parser then checks and builds like any other. The models:

- ``vgg16``: Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
  Recognition", 2014, arXiv:1409.1556 (configuration D, no batch normalisation).
- ``resnet50``: He, Zhang, Ren and Sun, "Deep Residual Learning for Image Recognition", 2015,
  arXiv:1512.03385 (bottleneck blocks 3, 4, 6, 3; the stride of a stage's first block on its
  3x3 convolution, as torchvision does, the variant known as ResNet v1.5).
- ``inception_v3``: Szegedy, Vanhoucke, Ioffe, Shlens and Wojna, "Rethinking the Inception
  Architecture for Computer Vision", 2015, arXiv:1512.00567 (without the auxiliary classifier).
- ``densenet121``: Huang, Liu, van der Maaten and Weinberger, "Densely Connected Convolutional
  Networks", 2016, arXiv:1608.06993 (growth rate 32, blocks 6, 12, 24, 16, bottleneck width 4
  times the growth rate, 64 initial features, compression 0.5).

Each structure follows torchvision's reference implementation layer for layer (``vgg16``,
``resnet50``, ``inception_v3(aux_logits=False)``, ``densenet121``), so at the default width and
resolution with 1000 classes the parameter counts are equal: 138,357,544, 25,557,032,
23,834,568 and 7,978,856. A convolution followed by batch normalisation has no bias, as there.

A layer list ends where torchvision's last ``Linear`` begins: the system appends the output
layer (a dense layer to the number of classes, flattening its input first). Two differences
from torchvision follow from the layer kinds there are:

- torchvision's VGG pools adaptively to 7x7 before its classifier; here the features are simply
  flattened, which is the same at 224x224 input (512·7·7 = 25,088 features), but at another
  resolution the first dense layer's input width, and so its parameter count, changes with it.
- The adaptive pools of the other three models before their classifiers are global average
  pools, which they are at any resolution.

The option ``width`` (default 1) multiplies every channel count, and VGG's hidden dense widths:
a count ``c`` becomes ``max(1, round(c * width))``. For DenseNet it scales the growth rate and
the initial features; the bottleneck width stays 4 times the growth rate and a transition halves
the channels it gets (rounding down), as in torchvision. The topology (which residual blocks
project their shortcut, how branches concatenate) does not depend on the width. The input
resolution is not an option here: the caller gives the input shape; ``min_resolution`` is the
smallest square side at which every spatial size stays at least 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..errors import InvalidArgument
from .checks import check_keys, shown

#: The keys ``expand`` accepts in its options.
OPTION_KEYS = ("width",)
#: The largest width multiplier (a VGG-16 four times as wide has about 2.2 billion parameters).
MAX_WIDTH_MULTIPLIER = 4.0


@dataclass(frozen=True)
class NamedModel:
    """One published network: its default input shape ``(C, H, W)``, the smallest square input
    side it accepts, where it was published, and a function from a channel scaling (``c`` to its
    scaled count) to a fresh layer list."""

    input_shape: tuple[int, int, int]
    min_resolution: int
    reference: str
    build: Callable[[Callable[[int], int]], list[dict]]


# --- layer objects ------------------------------------------------------------------------------


def _size(value: int | tuple[int, int]):
    """A kernel, stride or padding as the JSON writes it: one integer when square."""
    if isinstance(value, tuple):
        return value[0] if value[0] == value[1] else list(value)
    return value


def _conv(out: int, kernel=3, stride=1, padding=0, bias: bool = True, activation: str = "relu") -> dict:
    return {"conv": out, "kernel": _size(kernel), "stride": _size(stride), "padding": _size(padding),
            "bias": bias, "activation": activation}


def _bn(activation: str = "none", eps: float | None = None) -> dict:
    return {"batch_norm": {} if eps is None else {"eps": eps}, "activation": activation}


def _conv_bn(out: int, kernel=1, stride=1, padding=0, activation: str = "relu", eps: float | None = None) -> list[dict]:
    """A convolution without bias followed by batch normalisation and ``activation``."""
    return [_conv(out, kernel, stride, padding, bias=False, activation="none"), _bn(activation, eps)]


# --- VGG-16 -------------------------------------------------------------------------------------


def _vgg16(ch: Callable[[int], int]) -> list[dict]:
    layers: list[dict] = []
    for channels, convs in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
        layers += [_conv(ch(channels), 3, padding=1) for _ in range(convs)]
        layers.append({"max_pool": 2, "stride": 2})
    layers.append({"flatten": {}})
    layers += [{"dense": ch(4096), "activation": "relu", "dropout": 0.5} for _ in range(2)]
    return layers


# --- ResNet-50 ----------------------------------------------------------------------------------


def _resnet50(ch: Callable[[int], int]) -> list[dict]:
    layers = _conv_bn(ch(64), 7, 2, 3) + [{"max_pool": 3, "stride": 2, "padding": 1}]
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            s = stride if i == 0 else 1
            block = {"residual": _conv_bn(ch(planes), 1) + _conv_bn(ch(planes), 3, s, 1)
                                 + _conv_bn(ch(4 * planes), 1, activation="none")}
            if i == 0:      # every stage's first block changes the channels, so projects its shortcut
                block["shortcut"] = _conv_bn(ch(4 * planes), 1, s, activation="none")
            block["activation"] = "relu"
            layers.append(block)
    layers.append({"global_avg_pool": {}})
    return layers


# --- Inception-v3 -------------------------------------------------------------------------------


def _inception_v3(ch: Callable[[int], int]) -> list[dict]:
    def basic(out: int, kernel=1, stride=1, padding=0) -> list[dict]:
        # torchvision's BasicConv2d: convolution without bias, batch norm (eps 0.001), relu
        return _conv_bn(ch(out), kernel, stride, padding, eps=0.001)

    avg_pool_3x3 = {"avg_pool": 3, "stride": 1, "padding": 1}
    max_pool_3x3 = {"max_pool": 3, "stride": 2}

    def block_a(pool_features: int) -> dict:
        return {"concat": [
            basic(64),
            basic(48) + basic(64, 5, padding=2),
            basic(64) + basic(96, 3, padding=1) + basic(96, 3, padding=1),
            [dict(avg_pool_3x3)] + basic(pool_features),
        ]}

    def block_b() -> dict:
        return {"concat": [
            basic(384, 3, 2),
            basic(64) + basic(96, 3, padding=1) + basic(96, 3, 2),
            [dict(max_pool_3x3)],
        ]}

    def block_c(c7: int) -> dict:
        one_by_seven, seven_by_one = ((1, 7), (1, 1), (0, 3)), ((7, 1), (1, 1), (3, 0))
        return {"concat": [
            basic(192),
            basic(c7) + basic(c7, *one_by_seven) + basic(192, *seven_by_one),
            basic(c7) + basic(c7, *seven_by_one) + basic(c7, *one_by_seven) + basic(c7, *seven_by_one)
            + basic(192, *one_by_seven),
            [dict(avg_pool_3x3)] + basic(192),
        ]}

    def block_d() -> dict:
        return {"concat": [
            basic(192) + basic(320, 3, 2),
            basic(192) + basic(192, (1, 7), 1, (0, 3)) + basic(192, (7, 1), 1, (3, 0)) + basic(192, 3, 2),
            [dict(max_pool_3x3)],
        ]}

    def block_e() -> dict:
        def split() -> dict:   # a 1x3 and a 3x1 convolution side by side
            return {"concat": [basic(384, (1, 3), 1, (0, 1)), basic(384, (3, 1), 1, (1, 0))]}
        return {"concat": [
            basic(320),
            basic(384) + [split()],
            basic(448) + basic(384, 3, padding=1) + [split()],
            [dict(avg_pool_3x3)] + basic(192),
        ]}

    return (basic(32, 3, 2) + basic(32, 3) + basic(64, 3, padding=1) + [dict(max_pool_3x3)]
            + basic(80) + basic(192, 3) + [dict(max_pool_3x3)]
            + [block_a(32), block_a(64), block_a(64), block_b()]
            + [block_c(128), block_c(160), block_c(160), block_c(192), block_d()]
            + [block_e(), block_e(), {"global_avg_pool": {}}, {"dropout": 0.5}])


# --- DenseNet-121 -------------------------------------------------------------------------------


def _densenet121(ch: Callable[[int], int]) -> list[dict]:
    growth, features, bn_size = ch(32), ch(64), 4
    layers = _conv_bn(features, 7, 2, 3) + [{"max_pool": 3, "stride": 2, "padding": 1}]
    for b, count in enumerate((6, 12, 24, 16)):
        for _ in range(count):     # a dense layer: its input, and growth new channels from it
            new = [_bn("relu"), _conv(bn_size * growth, 1, bias=False, activation="none"),
                   _bn("relu"), _conv(growth, 3, padding=1, bias=False, activation="none")]
            layers.append({"concat": [[], new]})
            features += growth
        if b < 3:                  # a transition: halve the channels and the spatial size
            features //= 2
            layers += [_bn("relu"), _conv(features, 1, bias=False, activation="none"), {"avg_pool": 2, "stride": 2}]
    layers += [_bn("relu"), {"global_avg_pool": {}}]
    return layers


NAMED: dict[str, NamedModel] = {
    "vgg16": NamedModel((3, 224, 224), 32, "Simonyan & Zisserman 2014, arXiv:1409.1556", _vgg16),
    "resnet50": NamedModel((3, 224, 224), 1, "He et al. 2015, arXiv:1512.03385", _resnet50),
    "inception_v3": NamedModel((3, 299, 299), 75, "Szegedy et al. 2015, arXiv:1512.00567", _inception_v3),
    "densenet121": NamedModel((3, 224, 224), 29, "Huang et al. 2016, arXiv:1608.06993", _densenet121),
}


# --- expansion ----------------------------------------------------------------------------------


def expand(name: str, options: dict | None = None, where: str = "architecture") -> tuple[list[int], list[dict]]:
    """The default input shape ``[C, H, W]`` and a fresh layer list of the named model ``name``
    (one of NAMED), with ``options`` (keys OPTION_KEYS; None: none) applied. The list leaves out
    the output layer, which the caller appends. Raises InvalidArgument, its message prefixed with
    ``where``, for an unknown name, an unknown option or a bad option value."""
    model = NAMED.get(name) if isinstance(name, str) else None
    if model is None:
        raise InvalidArgument(f"{where}: unknown named model {shown(name)}; known models: {', '.join(NAMED)}")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InvalidArgument(f"{where}: the options of model {name!r} must be an object, got {shown(options)}")
    check_keys(options, OPTION_KEYS, where)
    width = options.get("width", 1.0)
    if (not isinstance(width, (int, float)) or isinstance(width, bool) or not math.isfinite(width)
            or not 0 < width <= MAX_WIDTH_MULTIPLIER):
        raise InvalidArgument(f'{where}."width" must be a number in (0, {MAX_WIDTH_MULTIPLIER:g}], '
                              f"got {shown(width)}")
    width = float(width)
    return list(model.input_shape), model.build(lambda c: max(1, round(c * width)))
