"""Model zoo and the exchanged-state helpers that define what goes over the wire.

Architectures follow the papers fedge implements:

- DS-FL (Itahara et al., IEEE TMC), Section 4.1 "ML model": the MNIST CNN (583,242 parameters), the Fashion-MNIST CNN
  (2,760,228), the IMDb LSTM and the Reuters text-DNN (5,194,670 values including batch-norm statistics).
- FedNTD (Lee et al., NeurIPS 2022), Appendix B.1: the two-conv CNN of McMahan et al. used for FedAvg.

Every model's ``forward(x)`` returns logits (pre-softmax); the papers' softmax outputs ``F(d|w)`` are computed by
callers. Every model also splits that forward in two, ``head(representation(x))``: the penultimate layer's output
(the input of the last linear layer) and the logits from it, for losses that compare representations (MOON); the
split adds no parameter and changes no output.

Forwards are kept export-friendly (``torch.export`` to ONNX and ExecuTorch): no data-dependent control flow, no
in-place ops, ``torch.flatten(x, 1)``, and max-pooling with an explicit stride because ExecuTorch 1.4.1's XNNPACK
partitioner crashes on ``max_pool2d`` without one.

The "exchanged state" of a model is what FL methods ship each round: every floating-point ``state_dict`` entry
(parameters plus batch-norm running mean and variance), without the integer ``num_batches_tracked`` counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import TypeAlias

import torch
from torch import nn

from fedge import plugins
from fedge.errors import ConfigError
from fedge.types import Logits, StateDict

ImageShape: TypeAlias = tuple[int, int, int]
"""Per-sample image shape ``(channels, height, width)``."""


def _pool(size: int) -> int:
    """Output size of ``nn.MaxPool2d(2, 2)`` along one axis (floor division, no padding)."""
    return size // 2


class DSFLMnistCNN(nn.Module):
    """DS-FL Section 4.1 MNIST CNN: two valid 5x5 convs (32, 64) with BN+ReLU+pool, fc 512 with BN+ReLU, fc 10.

    On 1x28x28 inputs it has 583,242 trainable parameters and 584,458 exchanged values (with BN running stats).
    Other square sizes of at least 16 pixels and other channel counts work too (the fc input is computed).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        side = _pool(_pool(image_size - 4) - 4)  # valid 5x5 conv, pool, valid 5x5 conv, pool
        if side < 1:
            raise ConfigError(
                f"dsfl_mnist_cnn needs images of at least 16x16 pixels (valid 5x5 convolutions), got {image_size}; "
                "use fedavg_cnn for small images"
            )
        self.input_shape: ImageShape = (in_channels, image_size, image_size)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 64, kernel_size=5),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 512),  # 1024 -> 512 on 28x28 inputs
            nn.BatchNorm1d(512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> Logits:
        """Logits ``(N, num_classes)`` for images ``(N, C, H, W)``."""
        return self.classifier(torch.flatten(self.features(x), 1))

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate layer's output (the input of the last linear layer): ``head(representation(x))`` is
        ``forward(x)``."""
        return self.classifier[:-1](torch.flatten(self.features(x), 1))

    def head(self, z: torch.Tensor) -> Logits:
        """Logits from :meth:`representation`'s output."""
        return self.classifier[-1](z)


class DSFLFashionCNN(nn.Module):
    """DS-FL Section 4.1 Fashion-MNIST CNN: six 'same' 3x3 convs (32, 32, 64, 64, 128, 128), each with BN+ReLU,
    then fc 382 and fc 192 (each BN+ReLU) and fc 10.

    The paper says "every two [convs] followed by 2x2 max pooling", but its count of 2,760,228 parameters only comes
    out with pooling after the 2nd and 4th conv (128x7x7 = 6,272 inputs to the first fc layer), so that is what is
    built here.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        side = _pool(_pool(image_size))
        if side < 1:
            raise ConfigError(f"dsfl_fmnist_cnn needs images of at least 4x4 pixels, got {image_size}")
        self.input_shape: ImageShape = (in_channels, image_size, image_size)
        layers: list[nn.Module] = []
        channels = [in_channels, 32, 32, 64, 64, 128, 128]
        for i, (c_in, c_out) in enumerate(itertools.pairwise(channels)):
            layers += [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
            if i in (1, 3):
                layers.append(nn.MaxPool2d(2, 2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(128 * side * side, 382),  # 6272 -> 382 on 28x28 inputs
            nn.BatchNorm1d(382),
            nn.ReLU(),
            nn.Linear(382, 192),
            nn.BatchNorm1d(192),
            nn.ReLU(),
            nn.Linear(192, num_classes),
        )

    def forward(self, x: torch.Tensor) -> Logits:
        """Logits ``(N, num_classes)`` for images ``(N, C, H, W)``."""
        return self.classifier(torch.flatten(self.features(x), 1))

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate layer's output (the input of the last linear layer): ``head(representation(x))`` is
        ``forward(x)``."""
        return self.classifier[:-1](torch.flatten(self.features(x), 1))

    def head(self, z: torch.Tensor) -> Logits:
        """Logits from :meth:`representation`'s output."""
        return self.classifier[-1](z)


class FedAvgCNN(nn.Module):
    """The CNN of McMahan et al. used by FedNTD (Appendix B.1): two 5x5 convs (32, 64, padding 2) each with ReLU and
    2x2 max-pooling, fc 512 with ReLU, fc ``num_classes``. No batch norm.

    1,663,370 parameters on 1x28x28; also fits 3x32x32 and the 1x8x8 scikit-learn digits.
    """

    def __init__(self, in_channels: int = 1, image_size: int | tuple[int, int] = 28, num_classes: int = 10) -> None:
        super().__init__()
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        out_h, out_w = _pool(_pool(height)), _pool(_pool(width))  # 'same' convs keep the size; each pool halves it
        if out_h < 1 or out_w < 1:
            raise ConfigError(f"fedavg_cnn needs images of at least 4x4 pixels, got {height}x{width}")
        self.input_shape: ImageShape = (in_channels, height, width)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * out_h * out_w, 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> Logits:
        """Logits ``(N, num_classes)`` for images ``(N, C, H, W)``."""
        return self.classifier(torch.flatten(self.features(x), 1))

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate layer's output (the input of the last linear layer): ``head(representation(x))`` is
        ``forward(x)``."""
        return self.classifier[:-1](torch.flatten(self.features(x), 1))

    def head(self, z: torch.Tensor) -> Logits:
        """Logits from :meth:`representation`'s output."""
        return self.classifier[-1](z)


class ReutersMLP(nn.Module):
    """DS-FL Section 4.1 Reuters text-DNN on bag-of-words vectors: ``vocab`` -> 512 -> 128 -> ``num_classes``, the
    hidden layers batch-normalized and ReLU-activated. 5,194,670 exchanged values with the paper's settings.
    """

    def __init__(self, vocab: int = 10000, num_classes: int = 46) -> None:
        super().__init__()
        self.input_shape: tuple[int] = (vocab,)
        self.layers = nn.Sequential(
            nn.Linear(vocab, 512),
            nn.BatchNorm1d(512),
            nn.ReLU(),
            nn.Linear(512, 128),
            nn.BatchNorm1d(128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> Logits:
        """Logits ``(N, num_classes)`` for binary bag-of-words vectors ``(N, vocab)`` (float)."""
        return self.layers(x)

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate layer's output (after the last hidden layer's ReLU)."""
        return self.layers[:-1](x)

    def head(self, z: torch.Tensor) -> Logits:
        return self.layers[-1](z)


class IMDbLSTM(nn.Module):
    """DS-FL Section 4.1 IMDb model (the Keras tutorial): embedding (32) -> LSTM (32 units) -> fc ``num_classes`` on
    the hidden state after the last time step.

    PyTorch's LSTM carries two bias vectors where Keras has one, so this model has 648,514 parameters against the
    paper's 646,338; the DS-FL Table II FL cost (28.6 MB) is matched within 1%.
    """

    def __init__(
        self, vocab: int = 20000, embed: int = 32, hidden: int = 32, num_classes: int = 2, seq_len: int = 200
    ) -> None:
        super().__init__()
        # seq_len only documents the expected input (the Keras tutorial keeps the first 200 words); any length works.
        self.input_shape: tuple[int] = (seq_len,)
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> Logits:
        """Logits ``(N, num_classes)`` for int64 token ids ``(N, L)``."""
        _, (h_n, _) = self.lstm(self.embedding(x))  # h_n: (1, N, hidden), the state after step L
        return self.fc(h_n[-1])

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The LSTM's hidden state after the last step (the input of the last linear layer)."""
        _, (h_n, _) = self.lstm(self.embedding(x))
        return h_n[-1]

    def head(self, z: torch.Tensor) -> Logits:
        return self.fc(z)


class TinyMLP(nn.Module):
    """A small two-layer perceptron on flattened inputs, for fast tests and smoke runs (not from a paper)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int = 10, hidden: int = 32) -> None:
        super().__init__()
        self.input_shape: tuple[int, ...] = tuple(input_shape)
        in_features = 1
        for d in input_shape:
            in_features *= d
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> Logits:
        """Logits ``(N, num_classes)`` for inputs ``(N, *input_shape)``."""
        return self.layers(torch.flatten(x, 1))

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden layer's output after its ReLU."""
        return self.layers[:-1](torch.flatten(x, 1))

    def head(self, z: torch.Tensor) -> Logits:
        return self.layers[-1](z)


# --- registry ---------------------------------------------------------------------------------------------------


def _image_shape(name: str, input_shape: tuple[int, ...]) -> ImageShape:
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ConfigError(f"{name} needs an image input_shape (channels, height, width), got {input_shape}")
    c, h, w = input_shape
    return c, h, w


def _square_image(name: str, input_shape: tuple[int, ...]) -> tuple[int, int]:
    c, h, w = _image_shape(name, input_shape)
    if h != w:
        raise ConfigError(f"{name} needs square images, got {h}x{w}; use fedavg_cnn for other sizes")
    return c, h


def _vector_length(name: str, input_shape: tuple[int, ...], what: str) -> int:
    if len(input_shape) != 1 or input_shape[0] < 1:
        raise ConfigError(f"{name} needs a 1-D input_shape ({what},), got {input_shape}")
    return input_shape[0]


def _build_dsfl_mnist(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, size = _square_image("dsfl_mnist_cnn", input_shape)
    return DSFLMnistCNN(num_classes, in_channels=c, image_size=size)


def _build_dsfl_fmnist(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, size = _square_image("dsfl_fmnist_cnn", input_shape)
    return DSFLFashionCNN(num_classes, in_channels=c, image_size=size)


def _build_fedavg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = _image_shape("fedavg_cnn", input_shape)
    return FedAvgCNN(in_channels=c, image_size=(h, w), num_classes=num_classes)


def _build_reuters(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return ReutersMLP(vocab=_vector_length("reuters_mlp", input_shape, "vocab"), num_classes=num_classes)


def _build_imdb(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return IMDbLSTM(num_classes=num_classes, seq_len=_vector_length("imdb_lstm", input_shape, "seq_len"))


def _build_tiny(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if not input_shape or min(input_shape) < 1:
        raise ConfigError(f"tiny_mlp needs a non-empty input_shape of positive sizes, got {input_shape}")
    return TinyMLP(input_shape, num_classes=num_classes)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "dsfl_mnist_cnn": _build_dsfl_mnist,
    "dsfl_fmnist_cnn": _build_dsfl_fmnist,
    "fedavg_cnn": _build_fedavg,
    "reuters_mlp": _build_reuters,
    "imdb_lstm": _build_imdb,
    "tiny_mlp": _build_tiny,
}
"""Model builders by name; each is called as ``builder(input_shape, num_classes)``. Use :func:`build_model`."""

_DEFAULT_MODELS: dict[str, str] = {
    "mnist": "fedavg_cnn",
    "fashion_mnist": "fedavg_cnn",
    "digits": "fedavg_cnn",
    "synthetic": "fedavg_cnn",
    "cifar10": "fedavg_cnn",
    "imdb": "imdb_lstm",
    "reuters": "reuters_mlp",
}

# Per-sample input shapes used when a model is named without one (the papers' datasets).
_DEFAULT_INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "dsfl_mnist_cnn": (1, 28, 28),
    "dsfl_fmnist_cnn": (1, 28, 28),
    "fedavg_cnn": (1, 28, 28),
    "reuters_mlp": (10000,),
    "imdb_lstm": (200,),
    "tiny_mlp": (1, 8, 8),
}


def build_model(name: str, *, input_shape: tuple[int, ...], num_classes: int, seed: int | None = None) -> nn.Module:
    """Build the registered model ``name`` for per-sample ``input_shape`` and ``num_classes`` outputs.

    With ``seed``, parameters are initialized from ``seed`` without disturbing the caller's global RNG state; without
    it, torch's default initialization draws from the global CPU generator. Raises :class:`ConfigError` for an
    unknown name or an input shape the model cannot take.
    """
    builder = _builder(name)
    if num_classes < 1:
        raise ConfigError(f"num_classes must be at least 1, got {num_classes}")
    shape = tuple(int(d) for d in input_shape)
    if seed is None:
        return builder(shape, num_classes)
    # devices=[]: fork only the CPU generator (models are built on CPU). Seeding through default_generator rather than
    # torch.manual_seed keeps CUDA generators untouched, which fork_rng(devices=[]) would not restore.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return builder(shape, num_classes)


def _builder(name: str) -> Callable[[tuple[int, ...], int], nn.Module]:
    """The built-in model ``name``, else a plugin's (:mod:`fedge.plugins`); ConfigError naming both kinds if neither."""
    if name in MODELS:
        return MODELS[name]
    factory = plugins.plugin_model(name)
    if factory is None:
        raise ConfigError(
            f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}"
            + "".join(f", {n} (plugin)" for n in plugins.plugin_model_names())
            + f"; a model of your own: --plugin MODULE_OR_FILE or {plugins.ENV} (docs/custom_models.md)"
        )
    return factory


def default_model_for(dataset_name: str) -> str:
    """The registry name of the model used for ``dataset_name`` when the user does not choose one."""
    if dataset_name not in _DEFAULT_MODELS:
        plugin_default = plugins.plugin_default_model(dataset_name)
        if plugin_default is not None:
            return plugin_default
        if dataset_name in plugins.plugin_dataset_names():
            raise ConfigError(f"dataset {dataset_name!r} (a plugin) names no default model: pass --model NAME")
        raise ConfigError(
            f"no default model for dataset {dataset_name!r}; known datasets: {', '.join(sorted(_DEFAULT_MODELS))}"
        )
    return _DEFAULT_MODELS[dataset_name]


def example_input(
    name_or_model: str | nn.Module,
    batch: int = 2,
    input_shape: tuple[int, ...] | None = None,
    *,
    seed: int = 0,
) -> torch.Tensor:
    """A deterministic example batch ``(batch, *input_shape)`` the model accepts, for export and tests.

    Token ids (int64, within the vocabulary) for ``imdb_lstm``, standard-normal float32 otherwise. The shape defaults
    to the model's ``input_shape`` attribute, or to the papers' dataset shape for a registry name.
    """
    if isinstance(name_or_model, str):
        if name_or_model not in MODELS:
            _builder(name_or_model)  # ConfigError for a name that is no plugin's either
            if input_shape is None:
                raise ConfigError(f"model {name_or_model!r} is a plugin's: give its input shape (--input-shape)")
        shape = input_shape or _DEFAULT_INPUT_SHAPES[name_or_model]
        vocab = 20000 if name_or_model == "imdb_lstm" else None
    else:
        model_shape = getattr(name_or_model, "input_shape", None)
        if input_shape is None and model_shape is None:
            raise ConfigError(f"{type(name_or_model).__name__} has no input_shape attribute; pass input_shape")
        shape = input_shape or tuple(model_shape or ())
        vocab = name_or_model.embedding.num_embeddings if isinstance(name_or_model, IMDbLSTM) else None
    generator = torch.Generator().manual_seed(seed)
    if vocab is not None:
        return torch.randint(0, vocab, (batch, *shape), generator=generator, dtype=torch.int64)
    return torch.randn((batch, *shape), generator=generator, dtype=torch.float32)


# --- exchanged state ----------------------------------------------------------------------------------------------


def _exchanged_items(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live (storage-sharing) floating-point state-dict entries, in state-dict order."""
    return {k: v for k, v in model.state_dict().items() if torch.is_floating_point(v)}


def exchanged_state(model: nn.Module) -> StateDict:
    """The values an FL round exchanges: parameters plus BN running mean/variance (no ``num_batches_tracked``),
    as detached clones in state-dict order.
    """
    return {k: v.detach().clone() for k, v in _exchanged_items(model).items()}


def load_exchanged_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy an exchanged state (see :func:`exchanged_state`) into ``model`` in place.

    Raises :class:`ConfigError` naming missing or unexpected keys, shape mismatches and non-floating-point values;
    the model is left unchanged when any check fails.
    """
    target = _exchanged_items(model)
    missing = [k for k in target if k not in state]
    unexpected = [k for k in state if k not in target]
    if missing or unexpected:
        raise ConfigError(f"state does not fit {type(model).__name__}: missing keys {missing}, unexpected {unexpected}")
    problems = []
    for key, dst in target.items():
        src = state[key]
        if not isinstance(src, torch.Tensor) or not torch.is_floating_point(src):
            problems.append(f"{key}: expected a floating-point tensor, got {getattr(src, 'dtype', type(src).__name__)}")
        elif src.shape != dst.shape:
            problems.append(f"{key}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    if problems:
        raise ConfigError(f"state does not fit {type(model).__name__}: " + "; ".join(problems))
    with torch.no_grad():
        for key, dst in target.items():
            dst.copy_(state[key])


def num_exchanged_values(model: nn.Module) -> int:
    """Number of scalar values in the model's exchanged state (parameters plus BN running statistics)."""
    return sum(v.numel() for v in _exchanged_items(model).values())


def num_trainable_parameters(model: nn.Module) -> int:
    """Number of scalar parameters with ``requires_grad``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


plugins.reserve_builtin_names("model", MODELS)
