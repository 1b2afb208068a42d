"""Checkpoints of (server, clients) with orbax; a round's checkpoint is written only after it passed the
non-finite check, and orbax writes to a temporary folder and renames, so the last good one stays intact.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ..errors import ConfigError


# Fields that may change between a run and its resumption; any other change is refused.
# (lr: a run stopped by NaN says to lower it.)
RESUMABLE_CHANGES = {"rounds", "resume", "overwrite", "out", "checkpoint_every", "eval_every", "strategy", "backend",
                     "chunk_size", "devices", "client_store", "eval_batch_size", "eval_point", "lr"}


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a write cut off) is dropped, a bad line before the
    last is an error."""
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ConfigError(f"--resume: line {i + 1} of {str(path)!r} is not valid JSON; the log is damaged "
                                  f"before its last line") from None
    return records


class Checkpointer:
    """Saves and restores the stacked state by round number (keeps the newest ``keep``)."""

    def __init__(self, directory: Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                 enable_async_checkpointing=False))

    def latest_round(self):
        return self.manager.latest_step()

    def save(self, round_idx: int, server, clients) -> None:
        self.manager.save(round_idx, args=ocp.args.StandardSave({"server": server, "clients": clients}))
        self.manager.wait_until_finished()

    def restore(self, round_idx: int, server, clients):
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"server": server, "clients": clients})
        state = self.manager.restore(round_idx, args=ocp.args.StandardRestore(target))
        return state["server"], state["clients"]

    def restore_latest(self, server, clients, cfg, metrics_path: Path):
        """(server, clients, next_round, history) from the newest checkpoint; checks the config matches."""
        step = self.latest_round()
        if step is None:
            raise ConfigError(f"--resume: no checkpoint in {str(self.directory)!r}")
        saved_cfg = self.directory.parent / "config.json"
        if saved_cfg.is_file():
            old = json.loads(saved_cfg.read_text())
            new = cfg.to_dict()
            # A field added to RunConfig after the run was saved counts as having its default value then.
            default = type(cfg)().to_dict()
            diff = sorted(k for k in new if k not in RESUMABLE_CHANGES and old.get(k, default.get(k)) != new[k])
            if diff:
                raise ConfigError(f"--resume: config differs from the checkpointed run in {diff}; "
                                  f"only {sorted(RESUMABLE_CHANGES)} may change")
        if cfg.rounds < step:
            raise ConfigError(f"--resume: the checkpoint is at round {step}; --rounds {cfg.rounds} must be at least "
                              f"{step}")
        history = [h for h in read_metrics(metrics_path) if h.get("round", 0) <= step]
        rounds = [h.get("round") for h in history]
        if rounds != list(range(1, step + 1)):
            have = f"rounds {rounds[0]}..{rounds[-1]} ({len(rounds)} records)" if rounds else "no records"
            raise ConfigError(f"--resume: {str(metrics_path)!r} holds {have} but the checkpoint is at round {step}; "
                              f"the run's log and checkpoint disagree (start a new run with --overwrite)")
        server, clients = self.restore(step, server, clients)
        return server, clients, step, history
