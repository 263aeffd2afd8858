"""Provisioning: each client's local data as a file, split from a run config exactly as the simulator splits it.

``fedge provision --out DIR [config flags]`` writes ``DIR/<client>.safetensors`` for every client, one
``DIR/shared.safetensors`` with what many clients hold (DS-FL's open set, FD's test set) and ``DIR/config.json``;
copy a client's file (and the shared one) to its device, and start the coordinator with ``--config DIR/config.json``.
The laptop runner uses the same function, so a laptop run and a deployment see identical client data.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from edge_client.data import ClientDataInfo, save_client_data, save_shared_data
from fedge.types import ClientId
from fedge_io.experiment import Experiment
from fedge_io.provenance import provenance


def write_client_files(exp: Experiment, directory: Path) -> dict[ClientId, Path]:
    """One data file per client of ``exp``, plus one shared file for the open set / test set when there is one."""
    directory.mkdir(parents=True, exist_ok=True)
    open_x = exp.open_x()
    datas = {c: exp.client_data(c, open_x) for c in sorted(exp.parts)}
    shared = None
    first = next(iter(datas.values()))
    if first.open_x is not None or first.eval_x is not None:
        shared = save_shared_data(directory / "shared.safetensors", first)
    out = {}
    for cid, data in datas.items():
        info = ClientDataInfo(client=cid, model=exp.model, input_shape=exp.input_shape, num_classes=exp.num_classes)
        out[cid] = save_client_data(directory / f"{cid}.safetensors", data, info, shared=shared)
    return out


def provision(exp: Experiment, directory: Path, *, plugins: Sequence[str] = ()) -> dict[ClientId, Path]:
    """:func:`write_client_files` plus the resolved ``config.json`` the coordinator should run with.

    ``plugins``: the ``--plugin`` entries the run's model or dataset comes from, recorded in config.json's ``fedge``
    record (with fedge's version; RunConfig.from_dict skips it): its coordinator and clients need them too.
    """
    files = write_client_files(exp, directory)
    written = {**exp.config.to_dict(), "fedge": {**provenance(), "plugins": list(plugins)}}
    (directory / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return files
