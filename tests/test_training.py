import torch
import torch.nn.functional as F

from fedge.models import build_model
from fedge.training import Objective, SGDSettings, batch_order, predict_logits, train


def test_batch_order_is_deterministic_and_covers_every_sample_each_epoch():
    a = batch_order(10, 2, 4, seed=5)
    assert [len(b) for b in a] == [4, 4, 2, 4, 4, 2]
    assert all(torch.equal(x, y) for x, y in zip(a, batch_order(10, 2, 4, seed=5), strict=True))
    assert sorted(torch.cat(a[:3]).tolist()) == list(range(10))
    assert not all(torch.equal(x, y) for x, y in zip(a, batch_order(10, 2, 4, seed=6), strict=True))


def test_batch_order_drops_a_trailing_single_sample():
    assert [len(b) for b in batch_order(9, 1, 4, seed=0)] == [4, 4]


def test_training_lowers_the_loss_and_is_reproducible():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    results = []
    for _ in range(2):
        model = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=2, seed=1)
        before = F.cross_entropy(predict_logits(model, x), y)
        train(model, x, y, Objective("ce"), SGDSettings(lr=0.05, momentum=0.9), epochs=5, batch_size=16, seed=3)
        after = F.cross_entropy(predict_logits(model, x), y)
        assert after < before
        results.append(predict_logits(model, x))
    assert torch.equal(results[0], results[1])


def test_fd_objective_ignores_masked_rows():
    logits = torch.randn(4, 3)
    y = torch.tensor([0, 1, 2, 0])
    aux = torch.softmax(torch.randn(4, 3), dim=1)
    none = torch.zeros(4, dtype=torch.bool)
    assert torch.allclose(Objective("fd", gamma=2.0).loss(logits, y, aux, none), F.cross_entropy(logits, y))
