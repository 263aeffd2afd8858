"""Resuming a killed run: the round engine's state goes into the run directory's journal after every round, and a
run continues from it after its last completed round, bit for bit.

What the journal holds (:mod:`fedge_io.journal`): the strategy's state (:meth:`fedge.algorithms.base.Strategy.state`:
global weights, SCAFFOLD's server control variate, FD's per-class outputs and contributors, DS-FL's global model, soft
labels and their round), the per-class accuracy history behind forgetting, the stores of clients that run in this
process (FD and DS-FL own models, SCAFFOLD's c_i), and where metrics.jsonl and ledger.csv end. The records and the
ledger so far are read back from those two files. Sampling and every seed derive from (seed, round): there is no
random-generator state to save.

Client stores are journaled one file per client, ``clients/<client>-<round>.safetensors``, written only in the rounds
that changed them (a sampled client's): a 1,000-client FD or DS-FL run with 10% sampled writes 100 small files a
round, not every client's model, and never holds a second copy of all of them to serialize. journal.json names each
client's current file; a newer one becomes current only when the journal naming it is committed, and the files it
supersedes are deleted after that, so a crash at any point leaves a journal whose files are all there.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from coordinator.engine import RoundEngine, RunHistory
from fedge.accounting.ledger import ByteLedger, read_ledger_csv
from fedge.accounting.records import RoundRecord
from fedge.algorithms.base import ClientStore
from fedge.config import RunConfig
from fedge.errors import JournalError
from fedge.types import ClientId, StateDict
from fedge_io.journal import RunState, atomic_write, finish_journal, read_journal, write_journal
from fedge_io.rundir import RunWriter, read_records

_STRATEGY = "strategy/"
_CLIENT = "client/"
_PER_CLASS = "history/per_class"
CLIENT_DIR = "clients"
_CLIENT_FILE = re.compile(r"[A-Za-z0-9_.-]{1,64}-\d{6,}\.safetensors")
SIDE_DIR = "journal-side"
_SIDE_FILE = re.compile(r"[0-9a-f]{32}\.safetensors")


class RunJournal:
    """Writes a run directory round by round, each round followed by its journal; restores a killed run from it.

    ``stores``: the own state of clients that run in this process, journaled with the server's (clients in other
    processes keep theirs; see docs/deployment.md, "If the coordinator dies"). ``changed``: returns (and forgets)
    the clients whose store changed since it was last called; without it every store is written every round.
    """

    def __init__(
        self,
        run_dir: Path,
        config: RunConfig,
        partition: Mapping[str, Any],
        engine: RoundEngine,
        *,
        resume: bool = False,
        stores: Mapping[ClientId, ClientStore] | None = None,
        changed: Callable[[], Iterable[ClientId]] | None = None,
    ) -> None:
        self.run_dir, self.config, self.engine = run_dir, config, engine
        self.stores = dict(stores or {})
        self.changed = changed
        self.client_files: dict[ClientId, str] = {}  # the committed file of each client's store
        self.client_digests: dict[ClientId, str] = {}  # their SHA-256, signed with the journal
        self.previous_files: dict[ClientId, str] = {}  # those of the previous journal (the fallback) are kept too
        # Side files (checkpoint): group -> (file, SHA-256) written; the files of the journal and of its fallback.
        self._side: dict[str, tuple[str, str]] = {}
        self._side_current: set[str] = set()
        self._side_previous: set[str] = set()
        if not resume:
            self.writer = RunWriter(run_dir, config, partition)
            self.committed = self.writer.written()
            return
        state = read_journal(run_dir, config)  # JournalError: none, finished, or another config's
        self.committed = (state.metrics_bytes, state.ledger_bytes)  # where metrics.jsonl and ledger.csv end
        self.writer = RunWriter(run_dir, config, partition, committed=self.committed)
        self._restore(state)

    @property
    def resumed_after(self) -> list[int]:
        return self.engine.history.resumed_after

    def round(self, record: RoundRecord) -> None:
        """Write the engine's latest round (its metrics line and messages), then commit the journal of its state."""
        self.prepare(record.round)(record)

    def prepare(self, rnd: int) -> Callable[[RoundRecord], None]:
        """Take round ``rnd``'s state now (right after its aggregation); returns what writes the round once its
        record is made, which may be later, on another thread, while the next round's clients change their stores
        and the strategy checks their replies (:class:`coordinator.engine.RoundPipeline`)."""
        history = self.engine.history
        entries = [e for e in history.ledger.entries if e.round == rnd]
        strategy_tensors, strategy_values = self.engine.strategy.state()
        tensors = {k: v.detach().clone() for k, v in _prefixed(_STRATEGY, strategy_tensors).items()}
        values = {
            "strategy": json.loads(json.dumps(strategy_values)),  # a copy: the next round may change the original
            "resumed_after": list(history.resumed_after),
        }
        which = set(self.changed()) if self.changed is not None else set(self.stores)
        stores = {
            c: {k: v.detach().contiguous().clone() for k, v in self.stores[c].items()}
            for c in sorted(which & set(self.stores))
        }

        def commit(record: RoundRecord) -> None:
            assert record.round == rnd, f"round {record.round} committed with the state of round {rnd}"
            metrics_bytes, ledger_bytes = self.writer.round(record, entries)
            if history.per_class_history:  # up to this round's evaluation: conclusions run in round order
                tensors[_PER_CLASS] = torch.from_numpy(np.stack(history.per_class_history))  # (evaluations, C)
            files, digests = self._write_client_stores(rnd, stores)
            state = RunState(
                rnd, tensors, {**values, "client_files": files, "client_sha256": digests}, metrics_bytes, ledger_bytes
            )
            write_journal(self.run_dir, self.config, state)
            self.committed = (metrics_bytes, ledger_bytes)
            self._rotate_side(set())
            self.previous_files, self.client_files, self.client_digests = self.client_files, files, digests
            self._delete_stale_client_files()

        return commit

    def checkpoint(self, group: Callable[[str], str | None] | None = None) -> None:
        """Commit the strategy's state as it is now over the journal of the last completed round (the same round,
        records and client files): FedBuff over MQTT (:mod:`coordinator.mqtt_fedbuff`) calls it with every accepted
        update, so a coordinator killed between two server steps resumes with its buffer and loses none of them.

        ``group``: names the group of a strategy tensor that never changes once it exists (a buffered update's move:
        :meth:`coordinator.fedbuff.BufferState.move_group`), or None. Each group is written to a file of its own in
        ``journal-side/``, once, and the journal names it with its SHA-256: a commit writes what is new, not every
        buffered move again."""
        history = self.engine.history
        strategy_tensors, strategy_values = self.engine.strategy.state()
        tensors: dict[str, torch.Tensor] = {}
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in strategy_tensors.items():
            key = group(name) if group is not None else None
            if key is None:
                tensors[_STRATEGY + name] = tensor
            else:
                groups.setdefault(key, {})[_STRATEGY + name] = tensor
        if history.per_class_history:
            tensors[_PER_CLASS] = torch.from_numpy(np.stack(history.per_class_history))  # (evaluations, C)
        side = self._write_side(groups)
        values = {
            "strategy": strategy_values,
            "resumed_after": list(history.resumed_after),
            "client_files": dict(self.client_files),
            "client_sha256": dict(self.client_digests),
            "side_files": side,
        }
        metrics_bytes, ledger_bytes = self.committed
        write_journal(
            self.run_dir, self.config, RunState(len(history.rounds), tensors, values, metrics_bytes, ledger_bytes)
        )
        self._rotate_side(set(side))

    def _write_side(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, str]:
        """Each group's file (written if new): {file name: SHA-256} for the journal."""
        written: dict[str, tuple[str, str]] = {}
        for key, part in groups.items():
            if key not in self._side:
                data = st_save({k: v.detach().contiguous() for k, v in part.items()})
                name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".safetensors"
                (self.run_dir / SIDE_DIR).mkdir(exist_ok=True)
                atomic_write(self.run_dir / SIDE_DIR / name, data)
                self._side[key] = (name, hashlib.sha256(data).hexdigest())
            written[key] = self._side[key]
        self._side = written  # groups gone from the state (stepped) are forgotten
        return dict(written.values())

    def _rotate_side(self, current: set[str]) -> None:
        """Keep the side files of the journal just committed and of its fallback; delete the others."""
        self._side_previous, self._side_current = self._side_current, current
        directory = self.run_dir / SIDE_DIR
        if not directory.is_dir():
            return
        for path in directory.iterdir():
            if path.name not in self._side_current | self._side_previous:
                path.unlink(missing_ok=True)

    def _write_client_stores(
        self, rnd: int, stores: Mapping[ClientId, ClientStore]
    ) -> tuple[dict[ClientId, str], dict[ClientId, str]]:
        """Write the stores that changed into new files; the mapping the next journal commits, and each file's
        SHA-256 (the journal signs them, so a store altered after the run is refused on resume)."""
        files, digests = dict(self.client_files), dict(self.client_digests)
        directory = self.run_dir / CLIENT_DIR
        for client, store in stores.items():
            if not store and client not in files:
                continue
            directory.mkdir(exist_ok=True)
            name = f"{client}-{rnd:06d}.safetensors"
            data = st_save(dict(store))
            atomic_write(directory / name, data)
            files[client], digests[client] = name, hashlib.sha256(data).hexdigest()
        return files, digests

    def _delete_stale_client_files(self) -> None:
        directory = self.run_dir / CLIENT_DIR
        if not directory.is_dir():
            return
        current = set(self.client_files.values()) | set(self.previous_files.values())
        for path in directory.iterdir():
            if path.name not in current:  # superseded, or written for a round whose journal never committed
                path.unlink(missing_ok=True)

    def finish(self, global_weights: StateDict | None, **kwargs: Any) -> dict[str, Any]:
        """Write the ledger, model and summary (:meth:`RunWriter.finish`), then mark the journal finished."""
        history = self.engine.history
        summary = self.writer.finish(history.rounds, history.ledger, global_weights, **kwargs)
        finish_journal(self.run_dir)
        self.client_files, self.previous_files = {}, {}
        self._delete_stale_client_files()  # a finished run cannot be resumed: its clients' stores are not needed
        if (self.run_dir / CLIENT_DIR).is_dir():
            (self.run_dir / CLIENT_DIR).rmdir()
        self._side_current = self._side_previous = set()
        self._rotate_side(set())
        if (self.run_dir / SIDE_DIR).is_dir():
            (self.run_dir / SIDE_DIR).rmdir()
        return summary

    def _restore(self, state: RunState) -> None:
        rounds = read_records(self.run_dir)
        if [r.round for r in rounds] != list(range(1, state.round + 1)):
            raise JournalError(
                f"{self.run_dir / 'metrics.jsonl'} does not hold rounds 1-{state.round} as its journal says: "
                "it was changed after the run"
            )
        ledger = ByteLedger()
        ledger.extend(read_ledger_csv(self.run_dir / "ledger.csv"))
        per_class = state.tensors.get(_PER_CLASS)
        self.engine.history = RunHistory(
            rounds=rounds,
            ledger=ledger,
            per_class_history=[] if per_class is None else [row.copy() for row in per_class.numpy()],
            resumed_after=[*state.values.get("resumed_after", []), state.round],
        )
        strategy_values = state.values.get("strategy", {})
        tensors = {**state.tensors, **self._read_side(state.values.get("side_files", {}))}
        self.engine.strategy.load_state(_part(_STRATEGY, tensors), strategy_values)
        files = state.values.get("client_files", {})
        digests = state.values.get("client_sha256")  # absent in journals from before store digests
        if not isinstance(files, dict) or not isinstance(digests, (dict, type(None))):
            raise JournalError(f"the journal in {self.run_dir} names its clients' files wrongly")
        for client, store in self.stores.items():
            store.clear()
            store.update(_part(f"{_CLIENT}{client}/", state.tensors))  # a journal from before per-client files
            name = files.get(client)
            if name is None:
                continue
            if not isinstance(name, str) or not _CLIENT_FILE.fullmatch(name):
                raise JournalError(f"the journal in {self.run_dir} names an invalid file for client {client!r}")
            path = self.run_dir / CLIENT_DIR / name
            try:
                data = path.read_bytes()
                if digests is not None and hashlib.sha256(data).hexdigest() != digests.get(client):
                    raise JournalError(
                        f"{path} is not the file the journal recorded (SHA-256 differs): it was altered or damaged"
                    )
                store.update(st_load(data))
            except (SafetensorError, OSError) as exc:
                raise JournalError(f"{path} cannot be read: {exc}") from None
        self.client_files = {c: n for c, n in files.items() if c in self.stores and isinstance(n, str)}
        self.client_digests = {
            c: d for c, d in (digests or {}).items() if c in self.client_files and isinstance(d, str)
        }

    def _read_side(self, files: object) -> dict[str, torch.Tensor]:
        """The tensors of the side files a journal names, each checked against its SHA-256 (signed with it)."""
        if not isinstance(files, dict):
            raise JournalError(f"the journal in {self.run_dir} names its side files wrongly")
        out: dict[str, torch.Tensor] = {}
        for name, digest in files.items():
            if not isinstance(name, str) or not _SIDE_FILE.fullmatch(name) or not isinstance(digest, str):
                raise JournalError(f"the journal in {self.run_dir} names an invalid side file {str(name)[:80]!r}")
            path = self.run_dir / SIDE_DIR / name
            try:
                data = path.read_bytes()
                if hashlib.sha256(data).hexdigest() != digest:
                    raise JournalError(
                        f"{path} is not the file the journal recorded (SHA-256 differs): it was altered or damaged"
                    )
                out.update(st_load(data))
            except (SafetensorError, OSError) as exc:
                raise JournalError(f"{path} cannot be read: {exc}") from None
        self._side_current = set(files)  # kept as the fallback's once the next journal is committed
        return out


def _prefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in tensors.items()}


def _part(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
