"""The named architectures of ``tensile_db.runtime.zoo``: their parameter counts equal
torchvision's reference implementations, ``width`` scales them, bad options raise InvalidArgument
naming the key, and every layer object uses only the keys of the architecture JSON.

The counts come from a walker written here, independent of the network parser: it follows the
layer list with the per-row shape and counts weights and biases of every layer, the appended
output layer included. When the parser (``tensile_db.runtime.network.build_network``) is present
its count is checked against the walker's too.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json

import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.runtime import zoo

# torchvision's models at 1000 classes (inception_v3 with aux_logits=False).
TORCHVISION_PARAMETERS = {
    "vgg16": 138_357_544,
    "resnet50": 25_557_032,
    "inception_v3": 23_834_568,
    "densenet121": 7_978_856,
}

ACTIVATIONS = {"relu", "tanh", "sigmoid", "none"}
# Every layer kind, with the other keys its object may hold.
LAYER_KEYS = {
    "conv": {"kernel", "stride", "padding", "dilation", "groups", "bias", "activation"},
    "batch_norm": {"activation"},
    "max_pool": {"stride", "padding"},
    "avg_pool": {"stride", "padding"},
    "global_avg_pool": set(),
    "flatten": set(),
    "dense": {"activation", "dropout"},
    "residual": {"shortcut", "activation"},
    "concat": set(),
    "activation": set(),
    "dropout": set(),
}


# --- an independent walker -----------------------------------------------------------------------


def pair(value) -> tuple[int, int]:
    if isinstance(value, list):
        assert len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value), value
        return value[0], value[1]
    assert isinstance(value, int) and not isinstance(value, bool), value
    return value, value


def out_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    n = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    assert n >= 1, f"spatial size {size} too small for kernel {kernel}, stride {stride}, padding {padding}"
    return n


def kind_of(layer: dict) -> str:
    kinds = [k for k in LAYER_KEYS if k in layer and k not in ("activation", "dropout")]
    if not kinds:   # an activation or dropout layer on its own
        kinds = [k for k in ("activation", "dropout") if k in layer]
    assert len(kinds) == 1, f"layer {layer} has {len(kinds)} kind keys"
    return kinds[0]


def walk(layers: list, shape: tuple) -> tuple[tuple, int]:
    """The output shape and the parameter count of ``layers`` on a per-row input ``shape``, each
    layer object checked to hold only the keys of its kind."""
    parameters = 0
    for layer in layers:
        assert isinstance(layer, dict), layer
        kind = kind_of(layer)
        extra = set(layer) - {kind} - LAYER_KEYS[kind]
        assert not extra, f"layer {layer} has keys {extra} not allowed for {kind}"
        if "activation" in layer:
            assert layer["activation"] in ACTIVATIONS, layer
        if kind == "conv":
            c, h, w = shape
            o, groups = layer["conv"], layer.get("groups", 1)
            kh, kw = pair(layer.get("kernel", 3))
            sh, sw = pair(layer.get("stride", 1))
            ph, pw = pair(layer.get("padding", 0))
            dh, dw = pair(layer.get("dilation", 1))
            assert isinstance(layer.get("bias", True), bool)
            assert c % groups == 0 and o % groups == 0
            parameters += o * (c // groups) * kh * kw + (o if layer.get("bias", True) else 0)
            shape = (o, out_size(h, kh, sh, ph, dh), out_size(w, kw, sw, pw, dw))
        elif kind == "batch_norm":
            assert len(shape) == 3 and set(layer["batch_norm"]) <= {"momentum", "eps"}, layer
            parameters += 2 * shape[0]
        elif kind in ("max_pool", "avg_pool"):
            c, h, w = shape
            k = pair(layer[kind])
            s = pair(layer.get("stride", layer[kind]))
            p = pair(layer.get("padding", 0))
            assert 2 * p[0] <= k[0] and 2 * p[1] <= k[1], layer    # as PyTorch requires
            shape = (c, out_size(h, k[0], s[0], p[0]), out_size(w, k[1], s[1], p[1]))
        elif kind == "global_avg_pool":
            assert layer[kind] == {} and len(shape) == 3
            shape = (shape[0],)
        elif kind == "flatten":
            assert layer[kind] == {}
            shape = (prod(shape),)
        elif kind == "dense":
            n = layer["dense"]
            parameters += prod(shape) * n + n
            shape = (n,)
            assert 0 <= layer.get("dropout", 0) < 1
        elif kind == "residual":
            body_shape, body = walk(layer["residual"], shape)
            short_shape, short = walk(layer.get("shortcut", []), shape)
            assert body_shape == short_shape, f"residual body {body_shape} and shortcut {short_shape} differ"
            parameters += body + short
            shape = body_shape
        elif kind == "concat":
            shapes = []
            for branch in layer["concat"]:
                branch_shape, n = walk(branch, shape)
                assert len(branch_shape) == 3, branch_shape
                shapes.append(branch_shape)
                parameters += n
            assert len({s[1:] for s in shapes}) == 1, f"concat branches of spatial sizes {shapes}"
            shape = (sum(s[0] for s in shapes),) + shapes[0][1:]
        elif kind == "dropout":
            assert 0 <= layer["dropout"] < 1
    return shape, parameters


def prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def count(layers: list, shape, classes: int = 1000) -> int:
    """Parameters of the network with the appended output layer (flattening its input)."""
    out, parameters = walk(layers, tuple(shape))
    return parameters + prod(out) * classes + classes


# --- parameter counts ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TORCHVISION_PARAMETERS))
def test_parameter_counts_equal_torchvision(name):
    shape, layers = zoo.expand(name, {})
    assert shape == ([3, 299, 299] if name == "inception_v3" else [3, 224, 224])
    assert count(layers, shape) == TORCHVISION_PARAMETERS[name]
    assert zoo.expand(name, {"width": 1})[1] == layers


def test_feature_shapes():
    final = {"vgg16": (4096,), "resnet50": (2048,), "inception_v3": (2048,), "densenet121": (1024,)}
    for name, model in zoo.NAMED.items():
        shape, layers = zoo.expand(name, {})
        assert walk(layers, tuple(shape))[0] == final[name]
        assert tuple(shape) == model.input_shape


def test_vgg_classifier_depends_on_resolution():
    # no adaptive pool: at 256x256 the flatten gives 512*8*8 features, not 512*7*7
    layers = zoo.expand("vgg16", {})[1]
    assert walk(layers[:-2], (3, 256, 256))[0] == (512 * 8 * 8,)
    assert count(layers, (3, 256, 256)) == TORCHVISION_PARAMETERS["vgg16"] + 512 * (64 - 49) * 4096
    # the other models end in a global average pool, so their counts do not depend on it
    for name in ("resnet50", "inception_v3", "densenet121"):
        assert count(zoo.expand(name, {})[1], (3, 320, 320)) == TORCHVISION_PARAMETERS[name]


@pytest.mark.parametrize("name", list(zoo.NAMED))
def test_min_resolution(name):
    side = zoo.NAMED[name].min_resolution
    layers = zoo.expand(name, {})[1]
    walk(layers, (3, side, side))
    if side > 1:
        with pytest.raises(AssertionError, match="too small"):
            walk(layers, (3, side - 1, side - 1))


def test_other_channel_counts_and_classes():
    layers = zoo.expand("resnet50", {})[1]
    # one input channel instead of three: only the first convolution's weight changes
    assert count(layers, (1, 224, 224)) == TORCHVISION_PARAMETERS["resnet50"] - 2 * 64 * 7 * 7
    assert count(layers, (3, 224, 224), classes=10) == TORCHVISION_PARAMETERS["resnet50"] - 990 * 2049


# --- width ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(zoo.NAMED))
def test_width_scales(name):
    shape, _ = zoo.expand(name, {})
    full = count(zoo.expand(name, {})[1], shape)
    quarter = count(zoo.expand(name, {"width": 0.25})[1], shape)
    # convolutions and hidden dense layers scale quadratically, so about a sixteenth
    assert quarter < full / 8
    wider = count(zoo.expand(name, {"width": 1.5})[1], shape)
    assert wider > 2 * full
    tiny = zoo.expand(name, {"width": 0.001})[1]     # every count rounds up to at least 1
    assert count(tiny, shape) < full / 100


def test_width_channel_rounding():
    layers = zoo.expand("resnet50", {"width": 0.5})[1]
    assert layers[0]["conv"] == 32
    assert walk(layers, (3, 224, 224))[0] == (1024,)
    dense = zoo.expand("densenet121", {"width": 0.5})[1]
    assert dense[0]["conv"] == 32                   # initial features
    first = dense[3]["concat"][1]
    assert first[1]["conv"] == 64 and first[3]["conv"] == 16    # bottleneck 4 x growth, growth 16
    assert walk(dense, (3, 224, 224))[0] == (512,)
    vgg = zoo.expand("vgg16", {"width": 0.25})[1]
    assert vgg[0]["conv"] == 16 and vgg[-1]["dense"] == 1024


# --- options and names ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", ["big", 0, -1, 4.5, float("nan"), float("inf"), True, None, [1]])
def test_bad_width(width):
    with pytest.raises(InvalidArgument, match=r'architecture\."width" must be a number in \(0, 4\]') as exc:
        zoo.expand("resnet50", {"width": width})
    assert "got " in str(exc.value)


def test_bad_width_message():
    with pytest.raises(InvalidArgument) as exc:
        zoo.expand("vgg16", {"width": "big"}, where="architecture.layers[0]")
    assert str(exc.value) == 'architecture.layers[0]."width" must be a number in (0, 4], got "big"'


def test_width_limits_accepted():
    def channels(width):
        _, layers = zoo.expand("densenet121", {"width": width})
        found = []

        def visit(items):
            for layer in items:
                if "conv" in layer:
                    found.append(layer["conv"])
                for branch in ([layer["residual"], layer.get("shortcut", [])] if "residual" in layer
                               else layer.get("concat", [])):
                    visit(branch)

        visit(layers)
        return found

    full, widest, narrowest = channels(1.0), channels(4), channels(1e-9)
    assert widest[0] == 4 * full[0] == 256                   # the stem: 64 features, four times
    assert narrowest[0] == 1 and len(narrowest) == len(full)  # the stem floors at 1; the structure stays
    assert all(n < f for n, f in zip(narrowest, full))


def test_unknown_option():
    with pytest.raises(InvalidArgument, match="depth") as exc:
        zoo.expand("resnet50", {"depth": 101})
    assert "architecture" in str(exc.value) and "width" in str(exc.value)
    assert zoo.OPTION_KEYS == ("width",)


def test_options_not_an_object():
    with pytest.raises(InvalidArgument, match="must be an object"):
        zoo.expand("resnet50", ["width"])
    assert zoo.expand("resnet50", None) == zoo.expand("resnet50", {})


@pytest.mark.parametrize("name", ["resnet18", "VGG16", "", 16, None])
def test_unknown_name(name):
    with pytest.raises(InvalidArgument, match="unknown named model") as exc:
        zoo.expand(name, {})
    for known in zoo.NAMED:
        assert known in str(exc.value)


def test_layers_are_json_and_fresh():
    for name in zoo.NAMED:
        shape, layers = zoo.expand(name, {})
        assert json.loads(json.dumps(layers)) == layers
        # a caller may change what it gets without changing the next expansion
        layers[0]["conv"] = 1
        shape[0] = 1
        again_shape, again = zoo.expand(name, {})
        assert again[0]["conv"] != 1 and again_shape[0] == 3


def test_no_shared_layer_objects():
    def ids(layers, seen):
        for layer in layers:
            assert id(layer) not in seen, layer
            seen.add(id(layer))
            for key in ("residual", "shortcut"):
                ids(layer.get(key, []), seen)
            for branch in layer.get("concat", []):
                ids(branch, seen)
    for name in zoo.NAMED:
        ids(zoo.expand(name, {})[1], set())


def test_torchvision_structure_details():
    resnet = zoo.expand("resnet50", {})[1]
    blocks = [l for l in resnet if "residual" in l]
    assert len(blocks) == 16 and sum("shortcut" in b for b in blocks) == 4
    second_stage = blocks[3]
    assert [l.get("stride") for l in second_stage["residual"] if "conv" in l] == [1, 2, 1]   # v1.5
    assert all(l["bias"] is False for b in blocks for l in b["residual"] if "conv" in l)
    inception = zoo.expand("inception_v3", {})[1]
    assert inception[1] == {"batch_norm": {"eps": 0.001}, "activation": "relu"}
    assert sum("concat" in l for l in inception) == 11
    vgg = zoo.expand("vgg16", {})[1]
    assert sum("conv" in l for l in vgg) == 13 and all(l["bias"] for l in vgg if "conv" in l)
    densenet = zoo.expand("densenet121", {})[1]
    assert sum("concat" in l for l in densenet) == 58


# --- the network parser, when present ------------------------------------------------------------


def parsed_network(shape: list, layers: list, classes: int):
    """The parser's network of ``layers`` on rows of ``shape``; skips while the parser is absent."""
    if importlib.util.find_spec("tensile_db.runtime.network") is None:
        pytest.skip("tensile_db.runtime.network is not written yet")
    network = importlib.import_module("tensile_db.runtime.network")
    if not hasattr(network, "build_network"):
        pytest.skip("tensile_db.runtime.network has no build_network yet")
    if "input_shape" in inspect.signature(network.build_network).parameters:
        # build_network(parsed layers, input shape, n_features, n_outputs)
        return network.build_network(network.parse_layers(layers, "architecture.layers"), tuple(shape),
                                     prod(shape), classes)
    return network.build_network({"input": {"shape": shape}, "layers": layers}, prod(shape), classes)


@pytest.mark.parametrize("name", list(TORCHVISION_PARAMETERS))
def test_parser_agrees(name):
    shape, layers = zoo.expand(name, {})
    net = parsed_network(shape, layers, 1000)
    assert net.n_parameters() == count(layers, shape) == TORCHVISION_PARAMETERS[name]


@pytest.mark.parametrize("name", list(zoo.NAMED))
def test_parser_agrees_on_width_and_shape(name):
    shape, layers = zoo.expand(name, {"width": 0.25})
    side = zoo.NAMED[name].min_resolution + 3
    shape = [1, side, side]
    net = parsed_network(shape, layers, 10)
    assert net.n_parameters() == count(layers, shape, classes=10)
