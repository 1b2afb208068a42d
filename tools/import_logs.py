"""Import run logs into the repository: every run folder under SRC (one holding ``config.json`` and
``metrics.jsonl``) is copied to the same relative folder under DST with only those two files, its machine paths
replaced by names, and its ``metrics.jsonl`` compacted (``tools/compact_logs.py``).

    python tools/import_logs.py SRC DST [--strip PATH=NAME ...] [--overwrite]

Replaced in ``config.json`` (longest path first): each ``--strip PATH=NAME``; the value of each environment
variable in ``VARIABLES`` that is set, by ``$VARIABLE`` (``$FEDTP_OFFICIAL``, ...); the repository root, by
nothing (``/repo/runs/x`` -> ``runs/x``). A JSON string that still starts with ``/`` afterwards is a machine path
the log would carry into the repository: the import stops with one line naming it, before anything is written.
A destination that already holds a run is kept unless ``--overwrite``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compact_logs import compact  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIABLES = ("JAXFL_DATA_DIR", "FEDTP_OFFICIAL", "DAPPERFL_OFFICIAL", "FEDSELECT_OFFICIAL", "RFEDDIS_OFFICIAL",
             "FEDPICK_OFFICIAL", "PFLLIB_OFFICIAL", "FLBENCH_OFFICIAL")


class LogError(Exception):
    """A log that cannot be imported as it is (the message names the file and the value)."""


def replacements(strip: list[str], environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(machine path, name) pairs, longest path first so that a folder inside another is replaced whole."""
    environ = os.environ if environ is None else environ
    pairs = []
    for item in strip:
        path, sep, name = item.partition("=")
        if not sep or not path.startswith("/"):
            raise LogError(f"--strip {item!r}: expected ABSOLUTE_PATH=NAME")
        pairs.append((path.rstrip("/"), name))
    for var in VARIABLES:
        if environ.get(var):
            for form in {environ[var].rstrip("/"), str(Path(environ[var]).resolve())}:
                if form.startswith("/"):
                    pairs.append((form, "$" + var))
    pairs.append((str(REPO) + "/", ""))
    return sorted(pairs, key=lambda p: -len(p[0]))


def strip_paths(value, pairs: list[tuple[str, str]]):
    """``value`` (parsed JSON) with every string's machine paths replaced by their names."""
    if isinstance(value, dict):
        return {k: strip_paths(v, pairs) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_paths(v, pairs) for v in value]
    if isinstance(value, str):
        for path, name in pairs:
            value = value.replace(path, name)
    return value


def machine_paths(value) -> list[str]:
    """The JSON strings of ``value`` that start with ``/``."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in machine_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in machine_paths(v)]
    return [value] if isinstance(value, str) and value.startswith("/") else []


def plan(src: Path, dst: Path, pairs: list[tuple[str, str]], overwrite: bool) -> list[tuple[Path, Path, dict]]:
    """(run folder, destination folder, stripped config) for each run under ``src``; raises on the first
    problem, before anything is written."""
    runs = sorted(p.parent for p in src.rglob("config.json") if (p.parent / "metrics.jsonl").is_file())
    if not runs:
        raise LogError(f"{src}: no run folder (config.json beside metrics.jsonl) under it")
    out = []
    for run in runs:
        target = dst / run.relative_to(src)
        if not overwrite and ((target / "metrics.jsonl.gz").exists() or (target / "metrics.jsonl").exists()):
            raise LogError(f"{target} already holds a run (--overwrite replaces it)")
        config = strip_paths(json.loads((run / "config.json").read_text()), pairs)
        left = machine_paths(config)
        if left:
            raise LogError(f"{run / 'config.json'} still names the machine path {left[0]!r} "
                               "(add --strip PATH=NAME)")
        out.append((run, target, config))
    return out


def import_logs(src: Path, dst: Path, strip: list[str] = (), overwrite: bool = False,
                environ: dict[str, str] | None = None) -> list[Path]:
    """Copy, strip and compact every run under ``src`` into ``dst``; the destination folders written."""
    pairs = replacements(list(strip), environ)
    written = []
    for run, target, config in plan(src, dst, pairs, overwrite):
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (target / "metrics.jsonl.gz").unlink(missing_ok=True)
        shutil.copyfile(run / "metrics.jsonl", target / "metrics.jsonl")
        compact(target / "metrics.jsonl")
        written.append(target)
    return written


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="import_logs", description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--strip", action="append", default=[], metavar="PATH=NAME")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        written = import_logs(a.src, a.dst, a.strip, a.overwrite)
    except LogError as e:
        print(f"import_logs: error: {e}", file=sys.stderr)
        return 2
    for target in written:
        print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
