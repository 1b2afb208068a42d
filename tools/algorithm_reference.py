"""Write docs/reference/algorithms.md from the algorithm registry: per algorithm its summary line, what it
shares and keeps, which run options it works with, every option (flag, type, default, allowed values, help)
and the "Deviations" list of its module docstring. Generated, never edited by hand; a test checks that the
committed file is what this script writes.

    python tools/algorithm_reference.py            # rewrite docs/reference/algorithms.md
    python tools/algorithm_reference.py --check    # exit 1 if the committed file differs
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "reference" / "algorithms.md"
CAPABILITIES = (("server_optimizer", "`--server-opt`"), ("user_dp", "`--dp-clip` (DP-FedAvg)"),
                ("sample_dp", "`--dp-level sample` (DP-SGD)"), ("poisson_sampling", "`--cohort-sampling poisson`"),
                ("cpu_device_split", "several CPU devices"))


def allowed(meta: dict) -> str:
    """The values an option allows, from its ``option(...)`` metadata."""
    if meta.get("choices"):
        return " \\| ".join(f"`{c}`" for c in meta["choices"])
    if meta.get("minimum") is not None:
        return f">= {meta['minimum']}"
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is None and hi is None:
        return ""
    left = "(" if meta.get("lo_open") or lo is None else "["
    return f"{left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"


def deviations(doc: str) -> list[str]:
    """The items of a module docstring's ``Deviations:`` section (continuation lines joined)."""
    lines, items, inside = doc.splitlines(), [], False
    for line in lines:
        if line.strip().startswith("Deviations"):
            inside = True
            continue
        if inside:
            if not line.strip():
                break
            if line.lstrip().startswith("- "):
                items.append(line.strip()[2:])
            elif items:
                items[-1] += " " + line.strip()
    return items


def section(name: str, options: type) -> str:
    """The markdown of one algorithm."""
    from jaxfl.core.options import field_type
    module = importlib.import_module(f"jaxfl.algorithms.{name}")
    doc = module.__doc__ or ""
    shares, keeps = options.sharing
    works = [label for attr, label in CAPABILITIES if getattr(options, attr)]
    summary = " ".join(doc.strip().split("\n\n")[0].split()) if doc.strip() else ""
    out = [f"## `{name}`", "", summary, "",
           f"- Module: `jaxfl/algorithms/{name}.py`; options: `{options.__name__}`",
           f"- Shares: {shares}", f"- Keeps per client: {keeps}",
           f"- Works with: {', '.join(works) if works else 'none of the optional run features'}"]
    if options.models:
        out.append(f"- Models: {', '.join(f'`{m}`' for m in options.models)}")
    if options.presets:
        out.append(f"- Presets by dataset: {', '.join(f'`{k}`' for k in options.presets)}")
    fields = options.fields()
    if fields:
        out += ["", "| flag | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in fields:
            flag = f"`--{name}.{f.name.replace('_', '-')}`"
            default = "-" if f.default is dataclasses.MISSING else f"`{f.default}`"
            text = f.metadata.get("help", "").replace("|", "\\|")
            out.append(f"| {flag} | {field_type(options, f).__name__} | {default} | {allowed(f.metadata)} | {text} |")
    devs = deviations(doc)
    if devs:
        out += ["", "Deviations from the reference:", ""] + [f"- {d}" for d in devs]
    return "\n".join(out) + "\n"


def reference() -> str:
    """The whole file."""
    from jaxfl.algorithms import REGISTRY
    head = ("# Algorithm reference\n\nGenerated from the registry by `python tools/algorithm_reference.py`; do "
            "not edit.\nEach algorithm's equations are in its module docstring, its provenance and commands in "
            "[../algorithms.md](../algorithms.md).\nOptions are given as `--NAME.OPTION` flags or as a `[NAME]` "
            f"table in a `--config` file. {len(REGISTRY)} algorithms.\n")
    return head + "\n" + "\n".join(section(n, REGISTRY[n].options) for n in sorted(REGISTRY))


def write_or_check(argv, doc: str, out: Path, build, script: str) -> None:
    """A generated reference's command line: write ``build()`` to ``out``, or with ``--check`` exit 1 if the
    committed file differs (``script``: the command that rewrites it)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if the committed file is not what would be written")
    args = p.parse_args(argv)
    text = build()
    if args.check:
        same = out.is_file() and out.read_text() == text
        print(f"{out}: {'up to date' if same else f'out of date: run python {script}'}")
        sys.exit(0 if same else 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")


def main(argv=None) -> None:
    write_or_check(argv, __doc__, OUT, reference, "tools/algorithm_reference.py")


if __name__ == "__main__":
    main()
