"""A client's algorithm state on disk (edge_client/state.py): written after each round, restored before a round."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_client.state import KEEP, ClientStateFiles
from fedge.errors import ConfigError


def test_the_newest_state_before_a_round_is_restored_and_only_the_last_few_are_kept(tmp_path: Path) -> None:
    files = ClientStateFiles(tmp_path, "lab", "c001")
    for rnd in (1, 2, 4, 5, 7):
        assert files.save(rnd, {"control.w": torch.full((2,), float(rnd))})
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [f"lab-c001-r{r:06d}.safetensors" for r in (4, 5, 7)] and len(kept) == KEEP
    restored = files.restore(before=7)  # a coordinator resumed after round 6 re-runs round 7
    assert restored is not None and restored[0] == 5 and torch.equal(restored[1]["control.w"], torch.full((2,), 5.0))
    assert files.restore(before=4) is None  # nothing that old is kept
    # Another client's or another run's files are not this one's.
    assert ClientStateFiles(tmp_path, "lab", "c002").restore(before=100) is None
    assert ClientStateFiles(tmp_path, "other", "c001").restore(before=100) is None


def test_an_unreadable_state_file_is_skipped_for_an_older_one_and_clear_removes_them(tmp_path: Path) -> None:
    files = ClientStateFiles(tmp_path, "lab", "c001")
    files.save(3, {"w": torch.ones(3)})
    files.save(4, {"w": torch.zeros(3)})
    (tmp_path / "lab-c001-r000004.safetensors").write_bytes(b"torn")
    restored = files.restore(before=5)
    assert restored is not None and restored[0] == 3
    files.clear()
    assert list(tmp_path.iterdir()) == []


def test_state_that_is_not_tensors_is_not_written_and_names_are_checked(tmp_path: Path) -> None:
    files = ClientStateFiles(tmp_path, "lab", "c001")
    assert not files.save(1, {"note": "text"})
    assert files.save(2, {})  # an algorithm without client state: an empty file, harmless
    with pytest.raises(ConfigError):
        ClientStateFiles(tmp_path, "lab/../x", "c001")


def test_the_client_flags_choose_where_the_state_lives_or_turn_it_off(tmp_path: Path) -> None:
    from edge_client.cli import state_files
    from fedge_cli.main import build_parser

    def parsed(*flags: str) -> ClientStateFiles | None:
        args = build_parser().parse_args(["client", "--data", str(tmp_path / "c001.safetensors"), *flags])
        args.run, args.client_id = "lab", "c001"  # what run_client resolves before asking
        return state_files(args)

    default = parsed()
    assert default is not None and default.directory == tmp_path / "state"
    chosen = parsed("--state-dir", str(tmp_path / "elsewhere"))
    assert chosen is not None and chosen.directory == tmp_path / "elsewhere"
    assert chosen.save(3, {"w": torch.ones(1)}) and (tmp_path / "elsewhere" / "lab-c001-r000003.safetensors").is_file()
    assert parsed("--no-state") is None
