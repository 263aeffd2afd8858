import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedge.algorithms.fedavg import CrossEntropy
from fedge.learning.models import FedAvgCNN, build_model, exchanged_state
from fedge.learning.pool_first import pool_before_relu
from fedge.learning.training import MomentumSGD, SGDSettings, TrainRequest, batch_order, predict_logits, train

CNNS = [("fedavg_cnn", (1, 8, 8)), ("dsfl_mnist_cnn", (1, 16, 16)), ("dsfl_fmnist_cnn", (1, 4, 4))]


def _tied(model: nn.Module, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Integer weights and images in a few levels: convolution sums are exact integers, so pooling windows hold tied
    maxima, exact zeros and all-negative values (the cases where the two orders could route gradients apart)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=gen).float())
    return torch.randint(-1, 2, (6, *shape), generator=gen).float()


@pytest.mark.parametrize(("name", "shape"), CNNS)
def test_the_pool_first_form_gives_the_same_logits_and_gradients_bit_for_bit(name, shape):
    gen = torch.Generator().manual_seed(0)
    model = build_model(name, input_shape=shape, num_classes=3, seed=0)
    x = _tied(model, shape, gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    fast = pool_before_relu(model)
    assert fast is not model
    model.train()
    results = []
    for form in (model, fast):
        model.zero_grad()
        logits = form(x)
        F.cross_entropy(logits, y).backward()
        results.append((logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert torch.equal(logits_a, logits_b)
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    # the case the tie-breaking argument is about did occur: some window's maximum was tied
    with torch.no_grad():
        conv_out = model.features[0](x)
        windows = conv_out.relu().unfold(2, 2, 2).unfold(3, 2, 2).flatten(-2)
        top = windows.max(dim=-1, keepdim=True).values
        assert int(((windows == top).sum(-1) > 1).sum()) > 0


def test_training_in_the_pool_first_form_trains_the_model_itself():
    """train() runs the pool-first form; the weights it leaves are those of the papers' order, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 1, 8, 8, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    fast_model = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=3, seed=2)
    papers = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=3, seed=2)
    sgd = SGDSettings(lr=0.1, momentum=0.9, weight_decay=1e-3)
    train(fast_model, TrainRequest(x, y, CrossEntropy(), sgd, epochs=2, batch_size=5, seed=3))
    opt = MomentumSGD(list(papers.parameters()), sgd)  # torch.optim.SGD's weights bit for bit (test_training.py)
    for idx in batch_order(20, 2, 5, seed=3):
        opt.zero_grad()
        F.cross_entropy(papers(x[idx]), y[idx]).backward()
        opt.step()
    a, b = exchanged_state(fast_model), exchanged_state(papers)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [type(m) for m in fast_model.features] == [type(m) for m in papers.features]  # the model keeps its order


def test_the_form_shares_the_models_weights_and_leaves_other_models_alone():
    model = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=3, seed=0)
    fast = pool_before_relu(model)
    assert [type(m) for m in fast.features] == [nn.Conv2d, nn.MaxPool2d, nn.ReLU] * 2
    assert [type(m) for m in model.features] == [nn.Conv2d, nn.ReLU, nn.MaxPool2d] * 2
    with torch.no_grad():
        model.features[0].weight.add_(1.0)
    assert fast.features[0].weight is model.features[0].weight
    assert dict(fast.state_dict()).keys() == dict(model.state_dict()).keys()
    assert pool_before_relu(fast) is fast  # nothing left to move
    tiny = build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=3, seed=0)
    assert pool_before_relu(tiny) is tiny

    class Sliced(FedAvgCNN):  # a subclass may use a slice of features: not rewritten
        pass

    sliced = Sliced(in_channels=1, image_size=8, num_classes=3)
    assert pool_before_relu(sliced) is sliced


def test_a_model_whose_layers_are_observed_runs_in_its_own_order():
    """A hook on a layer (the export gates' jitter and tie probes) sees that layer's input and output as the model
    computes them: such a model is not rewritten."""
    model = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=3, seed=0)
    seen: list[tuple[int, ...]] = []
    handle = model.features[1].register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    assert pool_before_relu(model) is model
    predict_logits(model, torch.randn(2, 1, 8, 8))
    assert seen == [(2, 32, 8, 8)]  # the ReLU ran on the convolution's full output, before the pool
    handle.remove()
    assert pool_before_relu(model) is not model
