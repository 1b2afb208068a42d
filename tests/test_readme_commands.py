"""Every `jaxfl run` example in the bash blocks of README.md and docs/ is a valid command: it parses and its
configuration validates through the CLI's own path (``cli.run_config``, then ``config.validate``, the first thing
``Experiment`` does), with nothing built or trained."""
import re
import shlex
from pathlib import Path

import pytest

from jaxfl.run import cli
from jaxfl.run.config import validate

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README] + sorted((ROOT / "docs").rglob("*.md"))  # the README and the guides


def readme_run_commands(text: str) -> list[str]:
    """`jaxfl run ...` commands of the ```bash blocks: continuation lines joined, `;`-separated commands split,
    comments and an output redirection (`> FILE`) dropped, schematic lines (with `...`) left out."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split(";"):
                m = re.search(r"(?:^|\s)(jaxfl run\b.*)$", part.split("#", 1)[0].strip())
                if m and "..." not in m.group(1):
                    cmds.append(re.sub(r"\s*>\s*\S+$", "", m.group(1)))
    return cmds


COMMANDS = [c for doc in DOCUMENTS for c in readme_run_commands(doc.read_text()) if "--help" not in c]


def test_the_readme_has_run_examples_and_the_extractor_finds_continued_lines():
    assert len(COMMANDS) >= 8
    assert any("--samples-per-client 50" in c and "--model char_lstm" in c for c in COMMANDS)
    assert readme_run_commands("```bash\njaxfl run --rounds 2 \\\n  --lr 0.1  # x\nls\n```\n") == [
        "jaxfl run --rounds 2    --lr 0.1"]
    assert readme_run_commands("```bash\njaxfl run --rounds 2 --print-config > my.toml  # x\n```\n") == [
        "jaxfl run --rounds 2 --print-config"]


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_run_example_is_a_valid_configuration(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --resume looks for runs/x/config.json here; nothing is written
    (tmp_path / "my.toml").write_text('algorithm = "fedavg"\nrounds = 3\n')
    args = vars(cli.build_parser().parse_args(shlex.split(command)[1:]))
    assert args.pop("command") == "run"
    for k in cli.PROCESS_OPTIONS:
        args.pop(k, None)
    cfg = validate(cli.run_config(args))
    rounds = re.search(r"--rounds (\d+)", command)
    if rounds:
        assert cfg.rounds == int(rounds.group(1))
    assert not any(tmp_path.glob("runs")), "validation wrote a run folder"


def test_a_stale_flag_in_an_example_would_fail():
    with pytest.raises(cli.UsageError, match="unrecognized arguments: --round-per-call 5"):
        cli.build_parser().parse_args(shlex.split("run --round-per-call 5"))


def test_the_readmes_library_example_runs(tmp_path):
    # the README's python block, run as written (in a fresh process: it builds its own data and backend)
    import subprocess
    import sys
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = [float(v) for v in out.stdout.strip().splitlines()[-1].strip("[]").split()]
    assert len(accuracy) == 3 and all(0.0 <= a <= 1.0 for a in accuracy)


PAIRED_SUMMARY = re.compile(r"(\d+) comparisons paired: (\d+) equivalent, (\d+) inconclusive, (\d+) different")
QUOTED_COUNTS = re.compile(r"(\d+) pairs: (\d+)\s+equivalent, (\d+)\s+inconclusive(?:\s+\([^)]*\))?,"
                           r"\s+(\d+)\s+different")


def quoted_pair_counts(text: str) -> list[tuple[str, ...]]:
    return QUOTED_COUNTS.findall(text)


def test_the_docs_quote_the_paired_tests_counts_as_paired_md_states_them():
    """README and the running guide quote paired.md's verdict counts; regenerating paired.md after a new pair must
    not leave them stale."""
    summary = PAIRED_SUMMARY.search((ROOT / "experiments" / "official" / "paired.md").read_text())
    assert summary, "paired.md has no summary line"
    for doc in ("README.md", "docs/guide/running.md"):
        quoted = quoted_pair_counts((ROOT / doc).read_text())
        assert quoted, f"{doc} quotes no pair counts"
        assert all(q == summary.groups() for q in quoted), (doc, quoted, summary.groups())


def test_a_stale_pair_count_would_be_seen():
    assert quoted_pair_counts("42 pairs: 24 equivalent, 17 inconclusive\n(too few seeds), 1 different") == [
        ("42", "24", "17", "1")]
    assert quoted_pair_counts("(42 pairs: 24\nequivalent, 17 inconclusive, 1 different;") == [("42", "24", "17", "1")]
