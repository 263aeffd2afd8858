"""Model zoo: the papers' parameter counts, forward shapes, exchanged state and seeded construction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedge.errors import ConfigError
from fedge.learning.models import (
    MODELS,
    DSFLFashionCNN,
    DSFLMnistCNN,
    FedAvgCNN,
    IMDbLSTM,
    ReutersMLP,
    build_model,
    default_model_for,
    example_input,
    exchanged_state,
    load_exchanged_state,
    num_exchanged_values,
    num_trainable_parameters,
)

# (name, input_shape, num_classes)
PAPER_MODELS = [
    ("dsfl_mnist_cnn", (1, 28, 28), 10),
    ("dsfl_fmnist_cnn", (1, 28, 28), 10),
    ("fedavg_cnn", (1, 28, 28), 10),
    ("reuters_mlp", (10000,), 46),
    ("imdb_lstm", (200,), 2),
    ("tiny_mlp", (1, 8, 8), 10),
]


def test_registry_names() -> None:
    assert {"dsfl_mnist_cnn", "dsfl_fmnist_cnn", "fedavg_cnn", "reuters_mlp", "imdb_lstm"} <= set(MODELS)


# DS-FL Section 4.1 gives 583,242 (MNIST), 2,760,228 (Fashion-MNIST) and 5,194,670 (Reuters, which counts the BN
# running statistics); FedAvg's CNN on MNIST has 1,663,370.
def test_dsfl_mnist_cnn_counts() -> None:
    model = DSFLMnistCNN()
    assert num_trainable_parameters(model) == 583_242
    assert num_exchanged_values(model) == 584_458


def test_dsfl_fashion_cnn_counts() -> None:
    model = DSFLFashionCNN()
    assert num_trainable_parameters(model) == 2_760_228
    # 128 x 7 x 7 features after two poolings feed the first fc layer
    assert model.classifier[0].in_features == 6272


def test_reuters_mlp_counts() -> None:
    assert num_exchanged_values(ReutersMLP()) == 5_194_670


def test_fedavg_cnn_counts() -> None:
    assert num_trainable_parameters(FedAvgCNN()) == 1_663_370


def test_imdb_lstm_counts() -> None:
    # PyTorch's LSTM has two bias vectors (Keras: one), hence 648,514 vs the paper's 646,338.
    assert num_trainable_parameters(IMDbLSTM()) == 648_514


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), PAPER_MODELS)
def test_forward_shape(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    model = build_model(name, input_shape=input_shape, num_classes=num_classes, seed=0)
    x = example_input(model, batch=2)
    assert x.shape == (2, *input_shape)
    assert model(x).shape == (2, num_classes)


@pytest.mark.parametrize("input_shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8)])
def test_fedavg_cnn_image_sizes(input_shape: tuple[int, int, int]) -> None:
    model = build_model("fedavg_cnn", input_shape=input_shape, num_classes=10, seed=0)
    out = model(example_input("fedavg_cnn", batch=2, input_shape=input_shape))
    assert out.shape == (2, 10)


def test_imdb_example_input_is_token_ids() -> None:
    x = example_input("imdb_lstm", batch=3)
    assert x.dtype == torch.int64
    assert x.shape == (3, 200)
    assert int(x.min()) >= 0 and int(x.max()) < 20000


def test_build_model_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match=r"known models: .*dsfl_mnist_cnn"):
        build_model("resnet", input_shape=(1, 28, 28), num_classes=10)
    with pytest.raises(ConfigError, match="dsfl_mnist_cnn"):
        build_model("dsfl_mnist_cnn", input_shape=(1, 8, 8), num_classes=10)  # too small for valid 5x5 convs
    with pytest.raises(ConfigError, match="image input_shape"):
        build_model("fedavg_cnn", input_shape=(784,), num_classes=10)
    with pytest.raises(ConfigError, match="1-D input_shape"):
        build_model("reuters_mlp", input_shape=(1, 28, 28), num_classes=46)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("fedavg_cnn", input_shape=(1, 28, 28), num_classes=0)


def test_default_model_for() -> None:
    assert default_model_for("mnist") == "fedavg_cnn"
    assert default_model_for("digits") == "fedavg_cnn"
    assert default_model_for("reuters") == "reuters_mlp"
    with pytest.raises(ConfigError, match="known datasets"):
        default_model_for("imagenet")


def test_exchanged_state_excludes_counters() -> None:
    model = DSFLMnistCNN()
    state = exchanged_state(model)
    assert not any(k.endswith("num_batches_tracked") for k in state)
    assert "features.1.running_mean" in state and "features.1.running_var" in state
    assert list(state) == [k for k in model.state_dict() if not k.endswith("num_batches_tracked")]
    assert sum(v.numel() for v in state.values()) == 584_458
    # clones, not views: editing the copy leaves the model alone
    state["features.0.weight"].zero_()
    assert model.state_dict()["features.0.weight"].abs().sum() > 0


def _trained_a_little(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Move the weights and BN statistics away from their initial values."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).logsumexp(dim=1).mean()
    loss.backward()
    opt.step()
    return model


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), [PAPER_MODELS[0], PAPER_MODELS[2], PAPER_MODELS[4]])
def test_exchanged_state_round_trip(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    x = example_input(name, batch=4, input_shape=input_shape)
    source = _trained_a_little(build_model(name, input_shape=input_shape, num_classes=num_classes, seed=1), x)
    target = build_model(name, input_shape=input_shape, num_classes=num_classes, seed=2)
    load_exchanged_state(target, exchanged_state(source))
    source.eval()
    target.eval()
    with torch.no_grad():
        assert torch.equal(source(x), target(x))


def test_load_exchanged_state_errors() -> None:
    model = DSFLMnistCNN()
    before = exchanged_state(model)
    state = exchanged_state(DSFLMnistCNN())

    missing = dict(state)
    del missing["features.1.running_var"]
    with pytest.raises(ConfigError, match=r"missing keys \['features.1.running_var'\]"):
        load_exchanged_state(model, missing)

    unexpected = {**state, "features.1.num_batches_tracked": torch.tensor(3)}
    with pytest.raises(ConfigError, match=r"unexpected .*num_batches_tracked"):
        load_exchanged_state(model, unexpected)

    wrong_shape = {**state, "classifier.3.bias": torch.zeros(11)}
    with pytest.raises(ConfigError, match=r"classifier.3.bias: expected shape \(10,\), got \(11,\)"):
        load_exchanged_state(model, wrong_shape)

    wrong_dtype = {**state, "classifier.3.bias": torch.zeros(10, dtype=torch.int64)}
    with pytest.raises(ConfigError, match="floating-point"):
        load_exchanged_state(model, wrong_dtype)

    after = exchanged_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load must leave the model unchanged"


def test_seed_determinism_and_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=10, seed=7)
    b = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=10, seed=7)
    c = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=10, seed=8)
    assert torch.equal(torch.rand(3), expected_next), "seeded construction must not advance the global RNG"
    sa, sb, sc = exchanged_state(a), exchanged_state(b), exchanged_state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["features.0.weight"], sc["features.0.weight"])


def test_export_friendly_forward() -> None:
    model = build_model("dsfl_mnist_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0).eval()
    x = example_input(model)
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        assert torch.allclose(program.module()(x), model(x))


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), PAPER_MODELS)
def test_head_of_the_representation_is_the_forward(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    """The representation/head split (for MOON) adds no parameter and gives the same logits."""
    model = build_model(name, input_shape=input_shape, num_classes=num_classes, seed=0).eval()
    x = example_input(name, 3, input_shape)
    z = model.representation(x)  # type: ignore[operator]
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert z.shape == (3, last.in_features)
    assert torch.equal(model.head(z), model(x))  # type: ignore[operator]
