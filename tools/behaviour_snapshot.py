"""Record every algorithm's metrics on the embedded data through the CLI, or compare two recordings bit for bit.

A refactoring must not change behaviour: run this before and after, then compare. Each case is
``jaxfl run`` on the embedded benchmark (6 clients, 4 per round, 4 rounds, evaluated every 2), under the
``map`` and ``vmap`` strategies, plus FedSelect evaluated right after local training (every client every
round). Only wall-clock fields (``time_s``, ``compile_s``) are ignored by the comparison.

    python tools/behaviour_snapshot.py record --out /tmp/before [--only fedavg,fedbn] [--backend ragged]
    python tools/behaviour_snapshot.py compare /tmp/before /tmp/after
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


IGNORED = ("time_s", "compile_s", "host_share")  # wall-clock fields
# small options for the algorithms whose defaults are slow on a CPU (as the tests shrink them)
SMALL = {"pfedhn": ["--pfedhn.inner-steps", "20"],
         "pfedgp": ["--pfedgp.train-draws", "4", "--pfedgp.test-draws", "4", "--pfedgp.gibbs-steps", "2"]}
MODEL = {"fedtp": "vit_tiny"}


def cases(names):
    for name in names:
        for strategy in ("map", "vmap"):
            yield f"{name}-{strategy}", [
                "--algorithm", name, "--model", MODEL.get(name, "small_cnn"), "--clients-per-domain", "2",
                "--clients-per-round", "4", "--rounds", "4", "--eval-every", "2", "--strategy", strategy,
                *SMALL.get(name, [])]
    for strategy in ("map", "vmap"):
        yield f"fedselect-local-{strategy}", ["--algorithm", "fedselect", "--model", "small_cnn", "--rounds", "4",
                                              "--eval-every", "2", "--eval-point", "local", "--strategy", strategy]


def record(out: Path, only: list[str] | None, backend: str | None) -> None:
    try:
        from jaxfl.run.cli import main
    except ImportError:  # the layout before the run/ package
        from jaxfl.cli import main
    from jaxfl.algorithms import REGISTRY
    names = only or list(REGISTRY)
    for label, args in cases(names):
        if (out / label / "metrics.jsonl").is_file():
            continue
        code = main(["run", "--quiet", "--dataset", "default", "--lr", "0.05", "--seed", "3",
                     "--out", str(out / label), *args, *(["--backend", backend] if backend else [])])
        print(label, "exit", code, flush=True)
        if code:
            sys.exit(code)


def strip(line: str) -> dict:
    rec = json.loads(line)
    return {k: v for k, v in rec.items() if k not in IGNORED}


def compare(a: Path, b: Path) -> int:
    labels = sorted(p.parent.name for p in a.glob("*/metrics.jsonl"))
    bad = 0
    for label in labels:
        fa, fb = a / label / "metrics.jsonl", b / label / "metrics.jsonl"
        if not fb.is_file():
            print(f"{label}: missing in {b}")
            bad += 1
            continue
        ra = [strip(x) for x in fa.read_text().splitlines()]
        rb = [strip(x) for x in fb.read_text().splitlines()]
        same = ra == rb
        bad += not same
        print(f"{label}: {'identical' if same else 'DIFFERENT'} ({len(ra)} rounds)")
    print(f"{len(labels) - bad} of {len(labels)} identical")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--only", default="")
    r.add_argument("--backend", default=None, help="stacked | ragged (the layout before the backends had none)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out, [s for s in args.only.split(",") if s] or None, args.backend)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
