"""Write docs/reference/run_options.md from the run options' declarations (``jaxfl.run.config.GROUPS``): per
group every option's flag, config key, type, default, allowed values and meaning. Generated, never edited by
hand; a test checks that the committed file is what this script writes.

    python tools/run_options_reference.py            # rewrite docs/reference/run_options.md
    python tools/run_options_reference.py --check    # exit 1 if the committed file differs
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_reference import allowed, write_or_check  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "reference" / "run_options.md"


def table(group, generated: dict) -> str:
    """The markdown of one group: a table of its options (``generated``: the help texts built from the
    registries, ``cli.generated_help``)."""
    from jaxfl.core.options import field_type
    out = [f"## {group.title}", "", "| flag (config key) | type | default | allowed | meaning |",
           "|---|---|---|---|---|"]
    declared = {f.name: f for f in dataclasses.fields(group)}
    for name in group.names():
        f = declared[name]
        tp = field_type(group, f).__name__
        default = "-" if f.default is None else f"`{f.default}`"
        text = generated.get(name, f.metadata.get("help", "")).replace("|", "\\|")
        out.append(f"| `--{name.replace('_', '-')}` (`{name}`) | {tp} | {default} | {allowed(f.metadata)} | {text} |")
    return "\n".join(out) + "\n"


def reference() -> str:
    """The whole file."""
    from jaxfl.run.cli import generated_help
    from jaxfl.run.config import GROUPS
    generated = generated_help()
    head = ("# Run options\n\nGenerated from the declarations in `jaxfl/run/config.py` by `python "
            "tools/run_options_reference.py`; do not edit.\nEach option is a `jaxfl run` flag and a key of a "
            "`--config` file (TOML or JSON); `--print-config` writes a run's whole configuration in these groups. "
            "A default of `-` is chosen at run time (the algorithm's protocol, the dataset's preset or the "
            "platform), as the meaning says. Algorithm options (`--NAME.OPTION`) are in "
            "[algorithms.md](algorithms.md).\n")
    return head + "\n" + "\n".join(table(g, generated) for g in GROUPS)


def main(argv=None) -> None:
    write_or_check(argv, __doc__, OUT, reference, "tools/run_options_reference.py")


if __name__ == "__main__":
    main()
