"""The PyTorch runtime. No GPU exists on CI machines, so the CUDA choice is checked with a mocked availability."""

import pytest
import torch

from fedge.algorithms.fedavg import CrossEntropy
from fedge.learning.backend import TorchBackend, resolve_device
from fedge.learning.training import SGDSettings, TrainRequest


def test_auto_picks_cuda_when_present(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_weights_round_trip_and_init_is_seeded():
    b = TorchBackend("tiny_mlp", (1, 8, 8), 10)
    w1, w2 = b.init_weights(7), b.init_weights(7)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    b.set_weights(w1)
    assert all(torch.equal(v, w1[k]) for k, v in b.get_weights().items())


def test_training_changes_weights_and_logits_have_the_right_shape():
    b = TorchBackend("tiny_mlp", (1, 8, 8), 10)
    b.set_weights(b.init_weights(0))
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    before = b.get_weights()
    stats = b.train(TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), epochs=1, batch_size=8, seed=0))
    assert stats.steps == 3 and stats.samples == 20
    assert any(not torch.equal(before[k], v) for k, v in b.get_weights().items())
    assert b.logits(x).shape == (20, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_training_matches_cpu():
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    results = []
    for device in ("cpu", "cuda"):
        b = TorchBackend("tiny_mlp", (1, 8, 8), 10, device=device)
        b.set_weights(b.init_weights(0))
        b.train(TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1, momentum=0.9), 2, 8, 0))
        results.append(b.get_weights())
    assert all(torch.allclose(results[0][k], results[1][k], atol=1e-5) for k in results[0])
