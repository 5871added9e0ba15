"""Reads back the runs Weights & Biases writes offline (`WANDB_MODE=offline`): each
`WORKDIR/wandb/offline-run-*/run-ID.wandb` is wandb's transaction log, LevelDB's log format
(after a 7-byte header, 32 KiB blocks of records, each a 7-byte header, checksum, length and
type, then its bytes; a record cut at a block's end continues in the next) holding
`wandb_internal_pb2.Record` protobufs. wandb 0.31 reads them in its Go core only."""

import glob
import json
import os
import struct

BLOCK, HEADER = 32768, 7
FULL, LAST = 1, 4


def _records(path):
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # Too little room for a header: the block is padded.
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            break
        pieces += data[pos + HEADER : pos + HEADER + n]
        pos += HEADER + n
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def offline_runs(workdir) -> list[dict]:
    """Each offline run under WORKDIR/wandb, oldest first: its id, project, config and the
    history rows it logged ({key: value}, `_step` included)."""
    runs = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
        run = {"history": []}
        for r in _records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["project"] = r.run.run_id, r.run.project
                run["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
                run["history"].append({k: json.loads(v) for k, v in row.items()})
        runs.append(run)
    return runs
