"""Suite-wide: a test that takes a broker fixture is a `broker` test, so `-m "not broker"` (make test-fast) leaves it
out without each test having to say so; and the slowest files are collected first, for the scheduling of `make test`.
"""

from __future__ import annotations

import pytest

BROKER_FIXTURES = frozenset({"mosquitto_url", "embedded_url", "broker_url", "fake_clients"})

# The files that take longest (each 1.5-8 minutes of one worker, `pytest --durations=0` on this project's 2-core
# machine), longest first. `make test` runs two workers that take one file at a time in collection order
# (`--dist loadfile --no-loadscope-reorder`); starting with these leaves the many short files to fill the end, instead
# of one worker running a long file alone for minutes while the other idles. Order only: every file still runs.
SLOW_FILES = (
    "tests/export/test_ort_training.py",
    "tests/export/test_executorch.py",
    "tests/sim/test_executors.py",
    "tests/sim/test_resume.py",
    "tests/coordinator/test_fleet_status.py",
    "tests/coordinator/test_walkthrough.py",
    "tests/coordinator/test_coordinator_gone.py",
    "tests/coordinator/test_resume.py",
    "tests/export/test_fleet.py",
    "tests/coordinator/test_faults.py",
    "tests/sim/test_ort_training_run.py",
    "tests/sim/test_demo.py",
    "tests/export/test_cli.py",
    "tests/fedge_cli/test_packaging.py",
    "tests/fedge_io/test_web_status.py",
    "tests/examples/test_custom_model.py",
    "tests/export/test_manifest.py",
    "tests/coordinator/test_insiders_dsfl.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if BROKER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.broker)
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread_per_test_worker() -> object:
    """Under ``pytest -n N`` each worker process computes on one intra-op thread. The workers (and the processes their
    tests start) already fill the cores; a worker's second OpenMP thread then waits for a core at every parallel
    region, and an in-process training loop of small tensors ran tens of times slower than alone (measured in
    this suite). Results do not change: the tests that compare thread counts set them explicitly."""
    import os

    import torch

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _dataset_cache(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Decoded datasets (fedge.data.cache) are cached in this session's temporary directory, not in ~/.cache."""
    from fedge.data.cache import ENV

    patch = pytest.MonkeyPatch()
    patch.setenv(ENV, str(tmp_path_factory.mktemp("dataset-cache")))
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def _journal_key(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Journals are signed with a key in this session's temporary directory (and the processes the tests start
    inherit it), not the per-user ~/.config/fedge/journal.key."""
    from fedge_io.journal_key import KEY_ENV

    patch = pytest.MonkeyPatch()
    patch.setenv(KEY_ENV, str(tmp_path_factory.mktemp("journal-key") / "journal.key"))
    yield
    patch.undo()
