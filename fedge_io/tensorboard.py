"""``--tensorboard DIR``: a run's round records as TensorBoard scalars, beside its metrics.jsonl.

Every number of a round's metrics.jsonl line (:meth:`fedge.accounting.records.RoundRecord.to_json`) becomes a scalar at
step = the round: accuracy and forgetting under ``accuracy/``, the algorithm's own metrics (``mean_local_loss``, ...)
under
``metrics/``, bytes under ``bytes/``, seconds under ``time/``, and per-class accuracy under ``per_class_accuracy/``.
Each run writes its own folder ``DIR/<run directory name>``, so ``tensorboard --logdir DIR`` shows runs side by side.
TensorBoard stores scalars as float32: byte counts above 2^24 are rounded to 7 significant digits there (metrics.jsonl
keeps them exact).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.accounting.records import RoundRecord
from fedge.errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

EXTRA_HINT = "pip install 'fedge[tensorboard]'"
_NOT_SCALARS = {"round", "quorum", "aggregated"}  # the step itself, and flags that are no measurements


def add_tensorboard_flag(p: argparse.ArgumentParser) -> None:
    """``--tensorboard DIR``, for the commands that write a run directory (fedge sim, fedge coordinator)."""
    p.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write each round's metrics (accuracy, loss, bytes, seconds) as TensorBoard scalars to "
        f"DIR/<run directory name>; needs {EXTRA_HINT}",
    )


def check_tensorboard() -> None:
    """ConfigError naming the extra when the ``tensorboard`` package is missing (checked before a run starts)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (imports tensorboard; fails without it)
    except ImportError as exc:
        raise ConfigError(f"--tensorboard needs the tensorboard package ({exc}): {EXTRA_HINT}") from None


def scalar_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: grouped so related series share a panel."""
    if key in ("accuracy", "forgetting"):
        return f"accuracy/{key}"
    if "bytes" in key:
        return f"bytes/{key}"
    if key.endswith("_s") or key.endswith("_s_max"):
        return f"time/{key}"
    return f"metrics/{key}"


def round_scalars(line: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics.jsonl line, by tag (numbers only: client lists, reasons and flags are not)."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key in _NOT_SCALARS or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[scalar_tag(key)] = float(value)
    for cls, value in enumerate(line.get("per_class_accuracy") or ()):
        if isinstance(value, (int, float)):  # None: a class absent from the evaluation set
            out[f"per_class_accuracy/{cls}"] = float(value)
    return out


class TensorBoardLog:
    """Writes each round record to ``root/<run_name>``; a resumed run's rounds replace what a killed run left after
    its last completed round (TensorBoard's purge of later steps)."""

    def __init__(self, root: Path, run_name: str) -> None:
        check_tensorboard()
        self.path = Path(root) / run_name
        self._writer: SummaryWriter | None = None

    def round(self, record: RoundRecord) -> None:
        """Add ``record``'s scalars at step ``record.round`` and flush them to disk (a run may be killed any time)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events of rounds >= this one (from a killed run) are dropped when TensorBoard reads the log.
            self._writer = SummaryWriter(log_dir=str(self.path), purge_step=record.round)
        for tag, value in round_scalars(record.to_json()).items():
            self._writer.add_scalar(tag, value, global_step=record.round)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
