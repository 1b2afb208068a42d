"""Compact committed run logs: each ``metrics.jsonl`` under the given folders becomes ``metrics.jsonl.gz``
(gzip, level 9, no timestamp in the header, so the same log gives the same bytes), which ``jaxfl compare``
reads as it reads the plain file (``jaxfl.run.compare.METRICS_FILES``). Prints the bytes before and after.

    python tools/compact_logs.py experiments/logs
"""
from __future__ import annotations

import gzip
import sys
from pathlib import Path


def compact(path: Path) -> tuple[int, int]:
    """Gzip one metrics.jsonl beside itself and remove it: (bytes before, bytes after)."""
    raw = path.read_bytes()
    packed = gzip.compress(raw, compresslevel=9, mtime=0)
    assert gzip.decompress(packed) == raw
    path.with_name(path.name + ".gz").write_bytes(packed)
    path.unlink()
    return len(raw), len(packed)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    before = after = files = 0
    for root in map(Path, argv):
        for path in sorted(root.rglob("metrics.jsonl")):
            b, a = compact(path)
            before, after, files = before + b, after + a, files + 1
    print(f"{files} logs: {before:,} -> {after:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
