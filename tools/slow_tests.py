"""Choose the tests the fast tier leaves out, from a full run's durations.

    python -m pytest -n 2 tests --full --durations=0 --durations-min=0 > durations.txt
    python tools/slow_tests.py durations.txt --budget 180 > tests/slow_tests.txt

Each test's time is its setup + call + teardown as pytest reports them (a module fixture's cost lands on the
first test that uses it). Tests are moved to the slow list from the slowest down until the rest sums to at most
``--budget`` seconds of worker time, except that every module keeps its fastest test, so the fast tier touches
every module. The fast tier is what ``pytest`` runs by default; ``--full`` (CI) runs everything.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+)\s*$")


def durations(text: str) -> dict[str, float]:
    """{node id: seconds} summed over setup, call and teardown, from pytest's ``--durations=0`` report."""
    total: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        found = LINE.match(line)
        if found:
            total[found.group(3)] += float(found.group(1))
    return dict(total)


def slow_set(times: dict[str, float], budget: float) -> list[str]:
    """The node ids to leave out: slowest first while the kept tests exceed ``budget`` seconds, never a
    module's fastest test."""
    keep = {}
    for node, t in times.items():
        module = node.split("::")[0]
        if module not in keep or t < times[keep[module]]:
            keep[module] = node
    protected = set(keep.values())
    left, slow = sum(times.values()), []
    for node in sorted(times, key=times.get, reverse=True):
        if left <= budget:
            break
        if node in protected:
            continue
        slow.append(node)
        left -= times[node]
    return sorted(slow)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("durations", help="the output of a full pytest run with --durations=0 --durations-min=0")
    p.add_argument("--budget", type=float, default=180.0, help="seconds of worker time the fast tier may take")
    args = p.parse_args(argv)
    times = durations(open(args.durations).read())
    if not times:
        sys.exit(f"{args.durations}: no durations found (run pytest with --durations=0 --durations-min=0)")
    slow = slow_set(times, args.budget)
    kept = sum(t for n, t in times.items() if n not in set(slow))
    print(f"# left out of the fast tier (pytest's default; --full runs them): {len(slow)} of {len(times)} tests, "
          f"{sum(times.values()) - kept:.0f} of {sum(times.values()):.0f} s of worker time; written by "
          f"tools/slow_tests.py --budget {args.budget:g}")
    print("\n".join(slow))


if __name__ == "__main__":
    main()
