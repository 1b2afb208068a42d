"""Checkpoints of (server, clients) with orbax, failing safe.

- A round's checkpoint is written only after it passed the non-finite check; orbax writes a step into a
  temporary folder and renames it when complete, so a kill at any point leaves the previous steps intact and
  at most an unfinished temporary folder, which is never read (and removed by the next save).
- Each saved step's SHA-256 over its arrays goes to ``digests.json`` (written to a temporary file, then
  renamed); a restore that fails or whose digest differs counts the step as damaged, and ``--resume`` falls
  back to the newest intact step (the damaged newer ones are deleted, the log trimmed to the step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..errors import ConfigError, first_line
from .config import RunConfig, holds_files, replace_text


# Fields that may change between a run and its resumption; any other change is refused.
# (lr: a run stopped by NaN says to lower it; dp_epsilon: only a target, the noise it calibrates must match;
# rounds_per_call: K rounds per call are bit for bit K single rounds; tail_batches and eval_tail_batches, like the
# strategy, change the computation only by float rounding.)
RESUMABLE_CHANGES = {"rounds", "resume", "overwrite", "out", "checkpoint_every", "eval_every", "strategy", "backend",
                     "chunk_size", "lane_segments", "lane_overhead", "devices", "client_store", "eval_batch_size",
                     "eval_point", "eval_model", "eval_clients", "lr", "dp_epsilon", "rounds_per_call",
                     "tail_batches", "eval_tail_batches"}


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (or a gzipped one, ``.gz``, also read when ``path`` names the plain file
    and only its gzipped twin exists: committed logs, ``tools/compact_logs.py``); a torn last line (a write cut
    off) is dropped, a bad line before the last is an error."""
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    if not path.is_file() and path.suffix != ".gz" and packed.is_file():
        path = packed
    if not path.is_file():
        lines = []
    else:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ConfigError(f"line {i + 1} of {str(path)!r} is not valid JSON; the log is damaged "
                                  f"before its last line") from None
    return records


@contextlib.contextmanager
def stderr_collected(pass_on_success: bool = True):
    """Collects what is written to file descriptor 2 (Python and native code: absl logs, TensorStore's
    thread tracebacks) while the block runs; passes it on if the block succeeds (and ``pass_on_success``),
    drops it otherwise."""
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok and pass_on_success:
                tmp.seek(0)
                if text := tmp.read():
                    os.write(2, text)


def state_digest(tree) -> str | None:
    """SHA-256 over every leaf's dtype, shape and bytes (in tree order); None when a leaf is not fully held by
    this process (a multi-process run: each process holds only its rows)."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return None
        a = np.asarray(jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                       else leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def checkpoint_steps(out: Path) -> list[int]:
    """The rounds of the finished checkpoints in ``out/checkpoints`` (none: [])."""
    directory = Path(out) / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def run_state(out: Path) -> str:
    """What ``out`` holds: ``new`` (missing, or nothing but a lock), ``started`` (a run's files but no
    checkpoint: stopped before its first one; ``--resume`` starts it again from round 0 with its saved config)
    or ``resumable`` (a checkpoint)."""
    out = Path(out)
    if not out.is_dir() or not holds_files(out):
        return "new"
    return "resumable" if checkpoint_steps(out) else "started"


def saved_settings(path: Path) -> dict:
    """A run's saved config.json as a dict; one ConfigError line naming the file and what to do when it cannot
    be read, is not JSON, is not a table of settings, or holds settings this version does not know (written
    by another version). Never advises --overwrite: the run's checkpoints may be intact."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: {str(path)!r} is not valid JSON ({first_line(e, 120)}); put the run's "
                          f"config.json back, or start the run again in another folder") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: {str(path)!r} holds a {type(saved).__name__}, not a run's settings; put the "
                          f"run's config.json back, or start the run again in another folder")
    from ..algorithms import REGISTRY  # (an algorithm's options are a table under its name)
    known = {f.name for f in dataclasses.fields(RunConfig)} | set(REGISTRY)
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ConfigError(f"--resume: {str(path)!r} has settings this jaxfl does not know ({unknown}): it was "
                          f"written by another version (a newer one, or one that named its settings otherwise); "
                          f"resume with that version")
    return saved


def check_resumable(cfg, out: Path, steps=None) -> None:
    """ConfigError unless ``cfg`` may resume the run in ``out``: its saved config.json (present, readable, of
    this version) differs only in ``RESUMABLE_CHANGES``, and ``rounds`` is at least the latest checkpoint's
    (``steps``: the checkpoints' rounds, default ``checkpoint_steps``; none: the run restarts from round 0).
    Cheap (no data, no jax): a run
    checks it before loading anything, with ``dp_noise`` left for after a ``dp_epsilon`` run calibrates it."""
    directory = Path(out) / "checkpoints"
    if steps is None:
        steps = checkpoint_steps(out)
    saved_cfg = Path(out) / "config.json"
    if not saved_cfg.is_file():
        if steps:  # (never --overwrite: the checkpoints are intact)
            raise ConfigError(f"--resume: {str(saved_cfg)!r} is missing, so the checkpoints in {str(directory)!r} "
                              f"cannot be matched to their settings; put the run's config.json back, or start the "
                              f"run again in another folder")
        raise ConfigError(f"--resume: {str(Path(out))!r} holds neither a checkpoint nor the run's config.json: no "
                          f"run started there; start one with --overwrite, or in another folder")
    if saved_cfg.is_file():
        old = saved_settings(saved_cfg)
        new = cfg.to_dict()
        # A field added to RunConfig after the run was saved counts as having its default value then.
        default = type(cfg)().to_dict()
        diff = sorted(k for k in new if k not in RESUMABLE_CHANGES and old.get(k, default.get(k)) != new[k])
        if cfg.dp_epsilon is not None and new.get("dp_noise") in (None, 0.0):  # not calibrated yet
            diff = [k for k in diff if k != "dp_noise"]
        if diff == ["dp_noise"] and cfg.dp_epsilon is not None:  # the target now calibrates another noise
            raise ConfigError(f"--resume: --dp-epsilon {cfg.dp_epsilon:g} over {cfg.rounds} rounds calibrates "
                              f"noise {cfg.dp_noise:g}, but the run so far used {old['dp_noise']!r}; continue "
                              f"with --dp-noise {old['dp_noise']!r} instead (the start-up line then says what "
                              f"the {cfg.rounds} rounds spend)")
        if diff:
            raise ConfigError(f"--resume: the settings differ from the run's {str(saved_cfg)!r} in {diff} (a "
                              f"flag given now, or a setting that file lacks: written by another version); only "
                              f"{sorted(RESUMABLE_CHANGES)} may change")
    if steps and cfg.rounds < max(steps):
        raise ConfigError(f"--resume: the checkpoint is at round {max(steps)}; --rounds {cfg.rounds} must be at "
                          f"least {max(steps)}")


class Checkpointer:
    """Saves and restores the stacked state by round number (keeps the newest ``keep``)."""

    def __init__(self, directory: Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        if jax.process_index() == 0 and self.directory.is_dir():  # the run's lock is held: nobody else writes
            for unfinished in self.directory.glob("*.orbax-checkpoint-tmp*"):  # a save cut off (kill, full disk)
                shutil.rmtree(unfinished, ignore_errors=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                 enable_async_checkpointing=False))

    def latest_round(self):
        return self.manager.latest_step()

    def _digests(self) -> dict:
        try:
            return json.loads((self.directory / "digests.json").read_text())
        except (OSError, ValueError):
            return {}

    def save(self, round_idx: int, server, clients) -> None:
        state = {"server": server, "clients": clients}
        with stderr_collected():  # a failed write is reported in one line by the caller, not by orbax
            try:
                self.manager.save(round_idx, args=ocp.args.StandardSave(state))
                self.manager.wait_until_finished()
            except BaseException:
                # let orbax finish tearing the failed write down (its threads may still log, e.g. "Event loop is
                # closed", seen once in the suite) while file descriptor 2 is still collected and dropped
                with contextlib.suppress(Exception):
                    self.manager.wait_until_finished()
                    self.manager.reload()
                raise
        digest = state_digest(state)
        if digest is not None and jax.process_index() == 0:
            kept = set(map(str, self.manager.all_steps()))
            digests = {k: v for k, v in self._digests().items() if k in kept}
            digests[str(round_idx)] = digest
            replace_text(self.directory / "digests.json", json.dumps(digests))

    def restore(self, round_idx: int, server, clients):
        """The state of step ``round_idx``; an exception if it does not restore or its digest differs."""
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"server": server, "clients": clients})
        state = self.manager.restore(round_idx, args=ocp.args.StandardRestore(target))
        want = self._digests().get(str(round_idx))
        if want is not None and state_digest(state) not in (None, want):
            raise ValueError("its arrays do not match the digest saved with it")
        return state["server"], state["clients"]

    def restore_intact(self, server, clients, notify=None):
        """(server, clients, step) of the newest step that restores; damaged newer steps are deleted and
        ``notify`` gets one line about them. ConfigError if none restores."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise ConfigError(f"--resume: no checkpoint in {str(self.directory)!r}")
        damaged = []
        for step in steps:
            try:
                restored = self.restore(step, server, clients)
            except Exception as e:  # noqa: BLE001 - any failure to read a step makes it unusable
                damaged.append((step, first_line(e, 160)))
                continue
            if damaged:
                for bad, _ in damaged:
                    shutil.rmtree(self.directory / str(bad), ignore_errors=True)
                self.manager.reload()
                if notify:
                    rounds = ", ".join(str(b) for b, _ in damaged)
                    notify(f"checkpoint(s) of round {rounds} in {str(self.directory)!r} do not restore "
                           f"({damaged[0][1]}); resuming from round {step}, the intact one before")
            return (*restored, step)
        raise ConfigError(f"--resume: no checkpoint in {str(self.directory)!r} restores (round "
                          f"{damaged[0][0]}: {damaged[0][1]}); start a new run with --overwrite")

    def restore_latest(self, server, clients, cfg, metrics_path: Path, notify=None):
        """(server, clients, next_round, history) from the newest intact checkpoint; checks the config
        matches, trims the log to the checkpoint."""
        steps = self.manager.all_steps()
        check_resumable(cfg, self.directory.parent, steps)
        if not steps:  # stopped before its first checkpoint: the run starts again (``run_state`` "started")
            if notify:
                notify(f"--resume: no checkpoint in {str(self.directory)!r} yet (the run stopped before its first "
                       f"one): starting again from round 0 with its saved config")
            return server, clients, 0, []
        server, clients, step = self.restore_intact(server, clients, notify)
        history = [h for h in read_metrics(metrics_path) if h.get("round", 0) <= step]
        rounds = [h.get("round") for h in history]
        if rounds != list(range(1, step + 1)):
            have = f"rounds {rounds[0]}..{rounds[-1]} ({len(rounds)} records)" if rounds else "no records"
            raise ConfigError(f"--resume: {str(metrics_path)!r} holds {have} but the checkpoint is at round {step}; "
                              f"the run's log and checkpoint disagree (start a new run with --overwrite)")
        return server, clients, step, history
