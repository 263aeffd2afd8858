"""fedge.data.augment: each transform by exact values on tiny images, seeded determinism, and the same model whichever
executor or transport runs an augmented run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedge.algorithms.catalog import make_objective
from fedge.config import RunConfig, TrainConfig
from fedge.data.augment import Augmentation, augment_batch, black_level, preset
from fedge.errors import ConfigError
from fedge.learning.training import SGDSettings, TrainRequest, batch_order

IMAGE = torch.arange(1.0, 10.0).view(1, 1, 3, 3)  # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
FILL = torch.tensor([-1.0])


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_crop_is_a_window_of_the_padded_image() -> None:
    padded = torch.tensor(
        [
            [-1, -1, -1, -1, -1],
            [-1, 1, 2, 3, -1],
            [-1, 4, 5, 6, -1],
            [-1, 7, 8, 9, -1],
            [-1, -1, -1, -1, -1],
        ],
        dtype=torch.float32,
    )
    windows = {(r, c): padded[r : r + 3, c : c + 3] for r in range(3) for c in range(3)}
    batch = IMAGE.expand(200, 1, 3, 3)
    out = augment_batch(batch, Augmentation(padding=1), FILL, _gen())
    seen = set()
    for image in out[:, 0]:
        match = [key for key, w in windows.items() if torch.equal(image, w)]
        assert len(match) == 1
        seen.add(match[0])
    assert seen == set(windows)  # every offset in [0, 2 * padding] occurs
    # The offsets are the generator's first draws, rows then columns.
    offsets = torch.randint(0, 3, (200, 2), generator=_gen())
    assert torch.equal(out[0, 0], windows[(int(offsets[0, 0]), int(offsets[0, 1]))])


def test_flip_mirrors_columns_and_probability_zero_keeps_the_image() -> None:
    flipped = augment_batch(IMAGE, Augmentation(flip=1.0), FILL, _gen())
    assert torch.equal(flipped[0, 0], torch.tensor([[3.0, 2, 1], [6, 5, 4], [9, 8, 7]]))
    assert torch.equal(augment_batch(IMAGE, Augmentation(), FILL, _gen()), IMAGE)
    many = augment_batch(IMAGE.expand(400, 1, 3, 3), Augmentation(flip=0.5), FILL, _gen())
    share = float((many[:, 0, 0, 0] == 3.0).float().mean())
    assert 0.4 < share < 0.6


def test_cutout_zeroes_a_square_around_the_drawn_centre_clipped_at_the_borders() -> None:
    x = torch.ones(300, 1, 4, 4)
    out = augment_batch(x, Augmentation(cutout=2), FILL, _gen(3))
    replay = _gen(3)
    rows, cols = torch.randint(0, 4, (300,), generator=replay), torch.randint(0, 4, (300,), generator=replay)
    for i in range(300):
        y, c = int(rows[i]), int(cols[i])
        expected = torch.ones(4, 4)
        expected[max(y - 1, 0) : min(y + 1, 4), max(c - 1, 0) : min(c + 1, 4)] = 0.0
        assert torch.equal(out[i, 0], expected), (y, c)
    # By hand: a centre at (0, 0) keeps rows and columns [0, 1) of the side-2 square, one pixel; inside, 2 x 2.
    zeros = (out[:, 0] == 0).sum(dim=(1, 2))
    assert int(zeros.min()) == 1 and int(zeros.max()) == 4


def test_the_paper_preset_scales_with_the_image() -> None:
    assert preset("paper", (1, 28, 28)) == Augmentation(padding=4, flip=0.5, cutout=16)
    assert preset("paper", (1, 8, 8)) == Augmentation(padding=1, flip=0.5, cutout=5)
    assert not preset("none", (1, 28, 28)).active
    with pytest.raises(ConfigError, match="needs images"):
        preset("paper", (784,))
    with pytest.raises(ConfigError, match="unknown augmentation 'mixup'"):
        preset("mixup", (1, 28, 28))


def test_black_level_is_each_channels_minimum() -> None:
    x = torch.tensor([[[[0.5, -0.4]], [[2.0, 1.0]]], [[[-0.42, 0.0]], [[3.0, 1.5]]]])  # (2, 2, 1, 2)
    assert torch.equal(black_level(x), torch.tensor([-0.42, 1.0]))


def _request(augment: Augmentation, seed: int = 7) -> TrainRequest:
    x = torch.randn(10, 1, 6, 6, generator=_gen(1))
    return TrainRequest(
        x, torch.zeros(10, dtype=torch.long), make_objective("ce"), SGDSettings(lr=0.1), 1, 5, seed, augment=augment
    )


def test_batches_are_deterministic_per_seed_and_step_and_differ_between_steps() -> None:
    aug = preset("paper", (1, 6, 6))
    a, b = _request(aug), _request(aug)
    idx = torch.arange(5)
    assert torch.equal(a.batch_x(idx, 0), b.batch_x(idx, 0))
    assert not torch.equal(a.batch_x(idx, 0), a.batch_x(idx, 1))
    assert not torch.equal(a.batch_x(idx, 0), _request(aug, seed=8).batch_x(idx, 0))
    assert torch.equal(_request(Augmentation()).batch_x(idx, 0), a.x[idx])  # no augmentation: the data as they are
    assert not torch.equal(a.batch_x(idx, 0), a.x[idx])


def test_a_teacher_sees_the_augmented_batch_the_student_sees() -> None:
    """FedNTD's authors compute the teacher's logits on each augmented batch (ClientTrainer._get_dg_logits(data))."""
    teacher = torch.nn.Linear(36, 3)
    logits = lambda x: teacher(x.flatten(1)).detach()  # noqa: E731
    x = torch.randn(10, 1, 6, 6, generator=_gen(1))
    clean = {"teacher": logits(x)}
    ntd = make_objective("ntd")
    plain = TrainRequest(x, torch.zeros(10, dtype=torch.long), ntd, SGDSettings(lr=0.1), 2, 4, 7, inputs=clean)
    assert plain.with_batch_logits("teacher", logits) is plain  # nothing augmented: the rows of inputs are the same
    request = dataclasses.replace(plain, augment=preset("paper", (1, 6, 6))).with_batch_logits("teacher", logits)
    order = batch_order(10, 2, 4, 7)
    assert len(request.step_inputs["teacher"]) == len(order) == 6  # 4 + 4 + 2 per epoch
    for step, idx in enumerate(order):
        got = request.batch_inputs(idx, step)["teacher"]
        assert torch.equal(got, logits(request.batch_x(idx, step)))
        assert not torch.equal(got, clean["teacher"][idx])


def test_an_augmented_fedntd_client_distills_the_teacher_on_augmented_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The teacher on the clean images instead gives another model: the option reaches the distillation term."""
    from sim.run import run_inprocess

    cfg = RunConfig(
        algorithm="fedntd",
        dataset="digits",
        model="tiny_mlp",
        num_clients=3,
        rounds=1,
        train=TrainConfig(augment="paper"),
    )
    run_inprocess(cfg, tmp_path / "batch")
    monkeypatch.setattr(TrainRequest, "with_batch_logits", lambda self, name, fn: self)  # fedge before this change
    run_inprocess(cfg, tmp_path / "clean")  # (sequential executor: the clients run in this process)
    a = load_file(tmp_path / "batch" / "global_model.safetensors")
    b = load_file(tmp_path / "clean" / "global_model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_the_option_changes_the_model_and_is_recorded(tmp_path: Path) -> None:
    from sim.run import run_inprocess

    models = {}
    for augment in ("none", "paper"):
        cfg = RunConfig(
            algorithm="fedavg",
            dataset="digits",
            model="tiny_mlp",
            num_clients=3,
            rounds=1,
            train=TrainConfig(augment=augment),
        )
        run_inprocess(cfg, tmp_path / augment)
        models[augment] = load_file(tmp_path / augment / "global_model.safetensors")
        assert f'"augment": "{augment}"' in (tmp_path / augment / "config.json").read_text()
    assert any(not torch.equal(models["none"][k], models["paper"][k]) for k in models["none"])


def test_train_size_takes_a_seeded_subset(tmp_path: Path) -> None:
    from fedge_io.experiment import prepare

    full = prepare(RunConfig(dataset="digits", num_clients=3))
    part = prepare(RunConfig(dataset="digits", num_clients=3, train_size=600))
    assert sum(len(v) for v in part.parts.values()) == 600 < sum(len(v) for v in full.parts.values())
    again = prepare(RunConfig(dataset="digits", num_clients=3, train_size=600))
    assert all((part.parts[c] == again.parts[c]).all() for c in part.parts)
    with pytest.raises(ConfigError, match="exceeds"):
        prepare(RunConfig(dataset="digits", num_clients=3, train_size=10**6))


@pytest.mark.broker
def test_sequential_processes_and_the_broker_give_one_model_with_augmentation(tmp_path: Path) -> None:
    from sim.laptop import run_over_mqtt
    from sim.run import run_inprocess

    cfg = RunConfig(
        algorithm="fedntd",
        dataset="digits",
        model="tiny_mlp",
        num_clients=3,
        rounds=2,
        train=TrainConfig(local_epochs=1, augment="paper"),
    )
    run_inprocess(cfg, tmp_path / "sequential")
    run_inprocess(cfg, tmp_path / "processes", executor="processes", workers=2)
    run_over_mqtt(cfg, tmp_path / "mqtt", broker=None, round_timeout=60)
    ref = load_file(tmp_path / "sequential" / "global_model.safetensors")
    for other in ("processes", "mqtt"):
        got = load_file(tmp_path / other / "global_model.safetensors")
        assert all(torch.equal(ref[k], got[k]) for k in ref), other
