"""The paired equivalence test of every official-code comparison whose logs of both sides are committed.

    .venv/bin/python experiments/official/paired.py [--out experiments/official/paired.md] [--margin 1.5]
        [--last-k 5]

Each comparison (``COMPARISONS``) names the official runs and jaxfl's runs of the same settings by a pattern (the
ones ``jaxfl compare --paired`` takes), the accuracy key its ``.md`` file used, and, quoted from that file, the
verdict of the criterion it applied. The script runs ``jaxfl.run.compare.paired_equivalence`` on each (official
minus jaxfl) and writes one markdown file: the test, a summary table, a line per comparison on the signs of the
per-seed differences, the patterns, and the comparisons that could not be paired with the reason. Run it from the
repository root; it reads only the committed logs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxfl.errors import ConfigError
from jaxfl.run.compare import accuracy_curve, aligned_curves, paired_equivalence, runs_by_seed

LOGS = "experiments/logs"
OFFICIAL = f"{LOGS}/official"
DAPPER_RELEASED = "dapperfl_use_fusionfalse_recover_modezero_bn_statsunmasked"


@dataclass(frozen=True)
class Comparison:
    """One official-vs-jaxfl comparison: the two sides' patterns (one run per seed each), the accuracy key, a
    short note, the verdict of the criterion its ``.md`` file applied (official - jaxfl, in points) and that
    file."""
    name: str
    official: str
    jaxfl: str
    key: str
    note: str
    unpaired: str
    doc: str


def _pfllib() -> list[Comparison]:
    """PFLlib's thirteen methods and the FedLC diagnostic (``pfllib.md``: mean over clients, final and last 5 of
    50 rounds, the jaxfl run of ``pfl_methods`` that each official config names as ``jaxfl_run``)."""
    rows = [  # (method, PFLlib folder, jaxfl run, unpaired verdict as official - jaxfl, note)
        ("FedAvg", "fedavg", "fedavg_lr0.05", "agree (final +0.25, bound 1.50)", "PFLlib is a reference"),
        ("local", "local", "local_lr0.05", "agree (final -0.07, bound 1.61)", "PFLlib is a reference"),
        ("FedALA", "fedala", "fedala_lr0.05", "agree (final +0.04, bound 1.50)", "PFLlib is the official code"),
        ("FedCP", "fedcp", "fedcp_lr0.005", "agree (final +0.21, bound 1.50)", "PFLlib is the official code"),
        ("GPFL", "gpfl", "gpfl_lr0.05", "agree (final +0.17, bound 1.50)", "PFLlib is the official code"),
        ("FedDBE", "feddbe", "feddbe_lr0.02", "agree (final -0.09, bound 1.50)", "PFLlib is the official code"),
        ("FedProto", "fedproto", "fedproto_lr0.05", "agree (final -0.10, bound 1.64)", "PFLlib is a reference"),
        ("FedAMP", "fedamp", "fedamp_lr0.05", "agree (final +0.15, bound 1.50)",
         "PFLlib is a reference; the proximal term is squared in jaxfl (the paper), not in PFLlib"),
        ("APFL", "apfl", "apfl_lr0.05", "agree (final +0.08, bound 1.88)",
         "PFLlib is a reference; its personal model trains on its own loss, jaxfl's through the mixture"),
        ("Per-FedAvg (FO)", "perfedavg", "perfedavg_lr0.02", "agree (final +1.01, bound 1.50)",
         "PFLlib takes twice jaxfl's meta-steps a round (jaxfl follows FL-bench's count)"),
        ("FedFomo", "fedfomo", "fedfomo_lr0.005", "agree (final +0.94, bound 2.02)",
         "PFLlib's port by design: top-M by affinity, l2, no epsilon-greedy (jaxfl follows the authors' code)"),
        ("FedPHP", "fedphp", "fedphp_lr0.05", "agree (final -0.78, bound 1.50)",
         "PFLlib's port by design: MMD, predicts with the local model (jaxfl follows the authors' FedRepo)"),
        ("FedLC", "fedlc", "fedlc_lr0.05", "DIFFER (final +2.52, bound 2.38)",
         "by design: PFLlib calibrates with the label counts of all clients, jaxfl with each client's own"),
    ]
    out = [Comparison(f"PFLlib {name}", f"{OFFICIAL}/pfllib/seed*/{folder}", f"{LOGS}/pfl_methods/seed*/{run}",
                      "mean_accuracy", note, unpaired, "pfllib.md") for name, folder, run, unpaired, note in rows]
    out.append(Comparison("PFLlib FedLC with jaxfl's per-client counts (diagnostic)",
                          f"{OFFICIAL}/pfllib_fedlc_client_counts/seed*/fedlc",
                          f"{LOGS}/pfl_methods/seed*/fedlc_lr0.05",
                          "mean_accuracy", "PFLlib's FedLC changed to calibrate with each client's own label counts",
                          "agree (final +0.18, bound 3.09)", "pfllib.md"))
    return out


def _fedrepo_stragglers() -> list[Comparison]:
    """FedRepo's FedNova and FedAvg on ``fedprox_stragglers``' inputs (``fedrepo.md``: pooled test accuracy,
    evaluated every 5th round, final and last 5 of 100 rounds; FedAvg against jaxfl's ``fedprox mu=0``)."""
    rows = [  # (straggler share, run folder, FedRepo method, lr, unpaired verdict as official - jaxfl)
        ("0", "fednova", "FedNova", "0.03", "agree (final +0.30, bound 1.73)"),
        ("0", "fednova_lr0.01", "FedNova", "0.01", "agree (final +0.00, bound 1.59)"),
        ("0", "fedprox_mu0", "FedAvg", "0.03", "agree (final +0.36, bound 1.69)"),
        ("0.5", "fednova_stragglers0.5", "FedNova", "0.03", "agree (final -7.44, bound 31.71)"),
        ("0.5", "fednova_stragglers0.5_lr0.01", "FedNova", "0.01", "agree (final -2.13, bound 16.41)"),
        ("0.5", "fedprox_mu0_stragglers0.5", "FedAvg", "0.03", "agree (final +0.44, bound 2.06)"),
        ("0.9", "fednova_stragglers0.9", "FedNova", "0.03", "agree (final +1.68, bound 10.96)"),
        ("0.9", "fednova_stragglers0.9_lr0.01", "FedNova", "0.01", "agree (final +0.37, bound 6.85)"),
        ("0.9", "fedprox_mu0_stragglers0.9", "FedAvg", "0.03", "agree (final +0.68, bound 2.45)"),
    ]
    out = []
    for s, run, method, lr, unpaired in rows:
        vs = "jaxfl fedprox mu=0" if method == "FedAvg" else "jaxfl fednova"
        out.append(Comparison(f"FedRepo {method} vs {vs}, stragglers {s}, lr {lr}",
                              f"{OFFICIAL}/fedrepo_stragglers/s{s}/seed*/{run}",
                              f"{LOGS}/fedprox_stragglers/s{s}/seed*/{run}", "weighted_accuracy",
                              "same cohorts, straggler draws and initial weights on both sides; FedRepo weighs clients "
                              "uniformly, jaxfl by samples", unpaired, "fedrepo.md"))
    return out


COMPARISONS: list[Comparison] = [
    Comparison("FedTP (hypernetwork)", f"{OFFICIAL}/fedtp/seed*/fedtp", f"{LOGS}/fedtp_seeds/seed*/fedtp",
               "weighted_accuracy", "CIFAR-10 pathological, vit_tiny, 60 rounds evaluated every 2nd",
               "agree (final +1.25, bound 7.55)", "fedtp.md"),
    Comparison("FedTP vanilla (personalized-T)", f"{OFFICIAL}/fedtp/seed*/vanilla",
               f"{LOGS}/fedtp_seeds/seed*/fedtp_variantvanilla", "weighted_accuracy",
               "CIFAR-10 pathological, vit_tiny, 60 rounds evaluated every 2nd",
               "agree (final +0.05, bound 1.89)", "fedtp.md"),
    Comparison("FedTP vanilla (personalized-T), jaxfl's W_qkv from the official law (library at 187e95c)",
               f"{OFFICIAL}/fedtp/seed*/vanilla", f"{LOGS}/fedtp_seeds_187e95c/seed*/fedtp_variantvanilla",
               "weighted_accuracy", "as the row above; jaxfl draws each block's W_qkv as the official code does "
               "(torch's Linear law) instead of Xavier-uniform; the official runs of seeds 3-4 at adapter 187e95c",
               "none (the paired test only)", "fedtp.md"),
    Comparison("FedTP vanilla (personalized-T), official configuration", f"{OFFICIAL}/fedtp_official_cfg/seed*/vanilla",
               f"{LOGS}/fedtp_official_cfg_torchinit/seed*/fedtp_variantvanilla", "weighted_accuracy",
               "CIFAR-10 pathological, the official ViT widths at depth 8 (vit_small), the official per-channel "
               "scaling, 20 rounds evaluated every 2nd", "none (the paired test only)", "fedtp.md"),
    Comparison("FedTP (hypernetwork), official configuration", f"{OFFICIAL}/fedtp_official_cfg/seed*/fedtp",
               f"{LOGS}/fedtp_official_cfg_torchinit/seed*/fedtp", "weighted_accuracy",
               "as the vanilla row above, 40 rounds; both codes near chance to round 20-30, then the hypernetwork's "
               "take-off (after round 20 at the reduced widths too)", "none (the paired test only)", "fedtp.md"),
    Comparison("FedTP vanilla, official configuration, jaxfl's W_qkv Xavier-uniform (library at c16aff8)",
               f"{OFFICIAL}/fedtp_official_cfg/seed*/vanilla", f"{LOGS}/fedtp_official_cfg/seed*/fedtp_variantvanilla",
               "weighted_accuracy", "as above, jaxfl's attention projections drawn from another law than the "
               "official code's (a diagnostic)", "none (the paired test only)", "fedtp.md"),
    Comparison("FedSelect", f"{OFFICIAL}/fedselect/seed*/fedselect", f"{LOGS}/fedselect_seeds/seed*/fedselect",
               "mean_accuracy", "CIFAR-10, FedAvg CNN, 15 rounds; single rounds swing by 5-10 points",
               "agree (final +5.60, bound 6.53)", "fedselect.md"),
    Comparison("FedSelect, official configuration, training mode kept",
               f"{OFFICIAL}/fedselect_resnet/train_mode/seed*/fedselect",
               f"{LOGS}/fedselect_resnet_official/train_mode/seed*/fedselect", "mean_accuracy",
               "CIFAR-10, torchvision's ResNet-18, ImageNet normalisation, crop + flip, 15 LocalAlt alternations, "
               "3 rounds (the window is all 3)", "none (the paired test only)", "fedselect.md"),
    Comparison("DapperFL vs jaxfl's released-code preset, 20 rounds", f"{OFFICIAL}/dapperfl/seed*/dapperfl",
               f"{LOGS}/dapperfl_seeds/seed*/{DAPPER_RELEASED}", "mean_accuracy",
               "`digits`, `resnet10_slim`; exact ties among BN scales are pruned differently by the two codes; jaxfl "
               "ran with weight decay 0, the official code with 1e-5",
               "differ (final -8.13, bound 6.87); agree (last 5 -5.27, bound 8.00)", "dapperfl.md"),
    Comparison("DapperFL vs jaxfl's spec preset, 20 rounds", f"{OFFICIAL}/dapperfl/seed*/dapperfl",
               f"{LOGS}/dapperfl_seeds/seed*/dapperfl", "mean_accuracy",
               "the spec preset (fusion, recovery from the global model, masked BN statistics) is not the "
               "released algorithm: a difference by design",
               "agree (final +9.38, bound 12.54); agree (last 5 +9.02, bound 10.84)", "dapperfl.md"),
    Comparison("DapperFL's FedAvg, 20 rounds", f"{OFFICIAL}/dapperfl/seed*/fedavg",
               f"{LOGS}/dapperfl_seeds/seed*/fedavg",
               "mean_accuracy", "the official DapperFL loop without pruning",
               "agree (final -0.12, bound 3.86); agree (last 5 -0.82, bound 2.78)", "dapperfl.md"),
    Comparison("DapperFL vs jaxfl's released-code preset, 100 rounds", f"{OFFICIAL}/dapperfl_long/seed*/dapperfl",
               f"{LOGS}/dapperfl_long/digits/seed*/{DAPPER_RELEASED}", "mean_accuracy",
               "curves move by up to 18-25 points between evaluations from round 60 on",
               "agree (final +5.06, bound 8.6); agree (rounds 80-100 -0.58, bound 4.1)", "experiments/RESULTS.md"),
    Comparison("DapperFL vs jaxfl's released-code preset, official configuration, 10 rounds",
               f"{OFFICIAL}/dapperfl_nf64/seed*/dapperfl_imagenetnorm_aug_nf64",
               f"{LOGS}/dapperfl_nf64/seed*/{DAPPER_RELEASED}", "mean_accuracy",
               "`digits`, ResNet-10 at nf = 64 (jaxfl `resnet10`), ImageNet scaling, crop + flip",
               "none (the paired test only)", "dapperfl.md"),
    Comparison("RFedDis, 6 rounds", f"{OFFICIAL}/rfeddis/seed*/rfeddis", f"{LOGS}/rfeddis_seeds/seed*/rfeddis",
               "mean_accuracy", "`digits`, `digits_cnn`, annealing horizon 6", "agree (final +0.20, bound 1.50)",
               "rfeddis.md"),
    Comparison("RFedDis, 6 rounds, the official code from jaxfl's initial weights (a diagnostic)",
               f"{OFFICIAL}/rfeddis/seed*/rfeddis_init_jaxfl", f"{LOGS}/rfeddis_seeds/seed*/rfeddis", "mean_accuracy",
               "as the row above; the adapter's --init jaxfl loads jaxfl's initial parameters of the same seed "
               "into the official model (the official batch orders unchanged)", "none (the paired test only)",
               "rfeddis.md"),
    *_pfllib(),
    Comparison("FL-bench Per-FedAvg (FO)", f"{OFFICIAL}/flbench/seed*/perfedavg",
               f"{LOGS}/pfl_methods/seed*/perfedavg_lr0.02",
               "mean_accuracy", "FL-bench weighs uploads uniformly, jaxfl by samples",
               "agree (final -0.11, bound 1.64)", "flbench.md"),
    Comparison("FL-bench Per-FedAvg (HF)", f"{OFFICIAL}/flbench/seed*/perfedavg_varianthf",
               f"{LOGS}/pfl_methods/seed*/perfedavg_varianthf_lr0.02", "mean_accuracy",
               "FL-bench weighs uploads uniformly, jaxfl by samples", "agree (final +0.41, bound 2.64)", "flbench.md"),
    Comparison("FedFomo (NVlabs/FedFomo)", f"{OFFICIAL}/fedfomo/seed*/fedfomo",
               f"{LOGS}/pfl_methods/seed*/fedfomo_lr0.005",
               "mean_accuracy", "the official round loop around its own server, federation and client classes",
               "agree (final -0.22, bound 2.23)", "fedfomo.md"),
    Comparison("FedProto (yuetan031/FedProto)", f"{OFFICIAL}/fedproto/seed*/fedproto",
               f"{LOGS}/fedproto_official_setting/seed*/fedproto_lr0.01", "mean_accuracy",
               "the official optimizer (SGD lr 0.01, momentum 0.5) on both sides",
               "agree (final -0.11, bound 1.64)", "fedproto.md"),
    Comparison("FedRepo FedAvg", f"{OFFICIAL}/fedrepo/seed*/fedavg", f"{LOGS}/pfl_methods/seed*/fedavg_lr0.05",
               "mean_accuracy", "FedRepo weighs clients uniformly, jaxfl by samples",
               "agree (final +0.23, bound 1.50)", "fedrepo.md"),
    Comparison("FedRepo FedNova", f"{OFFICIAL}/fedrepo/seed*/fednova", f"{LOGS}/pfl_methods/seed*/fednova_lr0.05",
               "mean_accuracy", "FedRepo's port of JYWa/FedNova, uniform client weights",
               "agree (final +0.13, bound 1.50)", "fedrepo.md"),
    Comparison("FedRepo FedPHP (authors' code)", f"{OFFICIAL}/fedrepo/seed*/fedphp",
               f"{LOGS}/pfl_methods/seed*/fedphp_lr0.05", "mean_accuracy", "prediction with the HPM on both sides",
               "agree (final +0.13, bound 1.50)", "fedrepo.md"),
    *_fedrepo_stragglers(),
    Comparison("RFedDis, 100 rounds", f"{OFFICIAL}/rfeddis_long/seed*/rfeddis", f"{LOGS}/rfeddis_long/digits/rfeddis",
               "mean_accuracy", "the official code ran seed 0 only; jaxfl's seeds 1 and 2 lie in "
               "rfeddis_long/digits/seed{1,2}/rfeddis",
               "agree (final -1.12, bound 1.5, one seed)", "experiments/RESULTS.md"),
]

NOT_RUNS = [  # documented comparisons without per-round accuracy logs of both sides
    ("PFLlib FedNova", "pfllib.md", "PFLlib has no FedNova: no official run (FedNova is paired against FedRepo's "
     "port above)"),
    ("PFLlib Per-FedAvg (HF)", "pfllib.md", "PFLlib ships the first-order variant only: no official run (HF is "
     "paired against FL-bench above)"),
    ("FedCP, one client's first local epoch", "fedcp.md", "a step-level comparison (losses and active features of "
     "50 steps from the same weights and batches, `experiments/logs/official/fedcp_steps/steps.md`), no per-round "
     "accuracy runs"),
    ("DapperFL weight-level check", "dapperfl.md", "two rounds of seed 0 from identical weights on 64 images per "
     "client (`experiments/logs/official/dapperfl/check_weights_seed0*.json`), not accuracy runs over seeds"),
    ("FedSelect exactness checks", "fedselect.md", "one round's tensors through both codes (`--check`), no logs"),
]


def side(pattern: str) -> dict[int, list[dict]]:
    """{seed: history} of one side's runs."""
    return {s: hist for s, (_, hist) in runs_by_seed(pattern).items()}


def ordinal(n: int) -> str:
    """``2nd``, ``3rd``, ``5th``, ``10th``."""
    return f"{n}{'th' if 10 <= n % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def fmt_rounds(rounds) -> str:
    """``52-60, every 2nd`` for an evenly spaced run of rounds, else the rounds listed."""
    rounds = [int(r) for r in rounds]
    if len(rounds) == 1:
        return str(rounds[0])
    steps = set(np.diff(rounds).tolist())
    if len(steps) == 1:
        step = steps.pop()
        return f"{rounds[0]}-{rounds[-1]}" + ("" if step == 1 else f", every {ordinal(step)}")
    return ", ".join(map(str, rounds))


def windows(a: dict, b: dict, seeds: list[int], key: str, tail: int) -> list[tuple[int, ...]]:
    """Per paired seed, the rounds of its last-``tail`` window (the last evaluations both runs made)."""
    return [tuple(aligned_curves([a[s], b[s]], key)[0][-tail:].tolist()) for s in seeds]


def evaluation_note(a: dict, b: dict, seeds: list[int], key: str, tail: int) -> str:
    """What the reader should know about the rounds compared: sides evaluated at different rounds, and a window
    that reaches into the first half of the run."""
    notes = []
    ra = sorted(set().union(*(accuracy_curve(a[s], key)[0].tolist() for s in seeds)))
    rb = sorted(set().union(*(accuracy_curve(b[s], key)[0].tolist() for s in seeds)))
    if ra != rb:
        common = sorted(set(ra) & set(rb))
        notes.append(f"the official runs evaluated rounds {fmt_rounds(ra)}, jaxfl's {fmt_rounds(rb)}: compared at "
                     f"the {len(common)} rounds both evaluated ({fmt_rounds(common)})")
    first, last = min(w[0] for w in windows(a, b, seeds, key, tail)), max(max(ra), max(rb))
    if first <= last / 2:
        notes.append(f"the window starts at round {first} of {last}: it includes the learning phase, not only the "
                     f"end of the run")
    return "; ".join(notes)


def pair(c: Comparison, tail: int, margin: float) -> dict:
    """The paired test of one comparison, with its window and notes; ``{"error": reason}`` when it cannot be
    paired (logs missing, fewer than 2 seeds on both sides)."""
    try:
        a, b = side(c.official), side(c.jaxfl)
    except ConfigError as e:
        return {"error": str(e)}
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        reason = f"seeds with runs: official {sorted(a)}, jaxfl {sorted(b)}; {len(seeds)} paired"
        if seeds:
            r = paired_equivalence(a, b, c.key, tail, margin)
            win = fmt_rounds(windows(a, b, seeds, c.key, tail)[0])
            reason += (f" (seed {seeds[0]}: official {r['a'][0]:.2f}, jaxfl {r['b'][0]:.2f}, difference "
                       f"{r['diff'][0]:+.2f} points over rounds {win}; no interval from one seed)")
            note = evaluation_note(a, b, seeds, c.key, tail)
            reason += f"; {note}" if note else ""
        return {"error": reason}
    r = paired_equivalence(a, b, c.key, tail, margin)
    wins = set(windows(a, b, seeds, c.key, tail))
    r["window"] = fmt_rounds(wins.pop()) if len(wins) == 1 else "differs by seed"
    r["eval_note"] = evaluation_note(a, b, seeds, c.key, tail)
    return r


def sentence(text: str) -> str:
    """``text`` as a sentence: its first letter capitalised, a full stop at its end."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def sign_line(r: dict) -> str:
    """The per-seed differences and whether they share a sign."""
    diffs = ", ".join(f"seed {s}: {d:+.2f}" for s, d in zip(r["seeds"], r["diff"]))
    if all(d > 0 for d in r["diff"]):
        same = f"official above jaxfl on all {len(r['diff'])} seeds"
    elif all(d < 0 for d in r["diff"]):
        same = f"official below jaxfl on all {len(r['diff'])} seeds"
    else:
        same = "mixed signs"
    zero = "; the interval excludes 0" if r["low"] > 0 or r["high"] < 0 else ""
    return f"{diffs} ({same}{zero})"


def summary_table(paired: list[tuple[Comparison, dict]]) -> list[str]:
    """The summary table, a row per paired comparison."""
    lines = ["| comparison | key | seeds | last-k window (rounds) | official % (mean) | jaxfl % (mean) | "
             "mean diff (points) | 90% interval | verdict | unpaired criterion (official - jaxfl) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, r in paired:
        lines.append(f"| {c.name} | {c.key} | {','.join(map(str, r['seeds']))} | {r['window']} | "
                     f"{np.mean(r['a']):.2f} | {np.mean(r['b']):.2f} | {r['mean']:+.2f} | "
                     f"[{r['low']:+.2f}, {r['high']:+.2f}] | **{r['verdict']}** | {c.unpaired or '-'} |")
    return lines


def counts_line(paired: list[tuple[Comparison, dict]]) -> str:
    """How many comparisons got each verdict (all three named, a verdict none got as 0)."""
    got = [r["verdict"] for _, r in paired]
    return ", ".join(f"{got.count(v)} {v}" for v in ("equivalent", "inconclusive", "different"))


def intro(args, command: str, commit: str) -> list[str]:
    """Title, provenance and what the test is."""
    k, m = args.last_k, args.margin
    return [
        "# Official code vs jaxfl: the paired equivalence test", "",
        f"Generated at commit {commit} by `{command}` from the committed logs (`experiments/logs/official/` and "
        "jaxfl's runs of the same settings under `experiments/logs/`). Each comparison is described in its "
        "`experiments/official/<name>.md`, the 100-round ones in `experiments/RESULTS.md` (setting, adapter, what "
        "is matched and what differs by design).", "",
        "The test. Both sides ran the same seeds on the same inputs. For each seed s, at the rounds both runs "
        f"evaluated, d_s = (mean of the last {k} evaluations of the official run) - (the same of jaxfl's run), in "
        "accuracy points. Over the n paired seeds: the mean of d and its 90% Student t-interval, mean -+ "
        "t(0.95, n-1) sd(d) / sqrt(n). The equivalence margin is "
        f"±{m:g} points, fixed before looking at the results; a 90% interval inside (-{m:g}, +{m:g}) is the two "
        "one-sided tests (TOST) at 5% each. Verdicts:", "",
        f"- **equivalent**: the interval lies inside (-{m:g}, +{m:g}): the two codes' accuracies differ by less "
        "than the margin (at 5% per side);",
        f"- **different**: the interval lies wholly outside [-{m:g}, +{m:g}]: they differ by more than the margin;",
        "- **inconclusive**: neither; the seeds do not settle it (more seeds, or a steadier window, would).", "",
        "With 3 seeds t(0.95, 2) = 2.92, so the interval's half-width is 1.69 sd(d): equivalence needs per-seed "
        "differences that are both small on average and consistent across seeds. What a seed fixes on both "
        "sides (the data, the cohorts and, where the adapter copies them, the initial weights) is shared within a "
        "pair, so the part of the seed-to-seed spread it causes cancels in d_s; minibatch orders and other draws "
        "of each code's own RNG do not.", "",
        "The last column quotes the verdict of the criterion the `.md` files applied (unpaired: the final means "
        "differ by at most max(2 pooled seed-stds, 1.5 points); some files also applied it to the last-5 means), "
        "with its difference turned to official - jaxfl (some files print jaxfl - official) and its bound. That "
        "bound grows with the seeds' spread, so a noisy comparison passes it easily; the paired test does not "
        "reward noise.", "",
    ]


def git_commit() -> str:
    """The short hash of HEAD (``unknown`` outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(args) -> str:
    """The command that reproduces the file (non-default options only)."""
    cmd = [".venv/bin/python", "experiments/official/paired.py"]
    defaults = {"out": "experiments/official/paired.md", "margin": 1.5, "last_k": 5}
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    return " ".join(cmd)


def report(args) -> str:
    """The whole markdown file."""
    paired, unpaired = [], []
    for c in COMPARISONS:
        r = pair(c, args.last_k, args.margin)
        (unpaired if "error" in r else paired).append((c, r))
    lines = intro(args, command_line(args), git_commit())
    lines += ["## Summary", "", f"{len(paired)} comparisons paired: {counts_line(paired)}. Official - jaxfl; "
              f"official % and jaxfl % are the means over seeds of each run's last-{args.last_k} mean.", ""]
    lines += summary_table(paired)
    lines += ["", "## Per comparison: per-seed differences (official - jaxfl, points) and notes", ""]
    for c, r in paired:
        extra = "; ".join(x for x in (c.note, r["eval_note"]) if x)
        lines.append(f"- **{c.name}** (`{c.doc}`): {sign_line(r)}." + (f" {sentence(extra)}" if extra else ""))
    lines += ["", "## Patterns", "", "Each row again with `jaxfl compare --paired OFFICIAL JAXFL --key KEY "
              f"--last-k {args.last_k} --margin {args.margin:g}` (quote the patterns):", "",
              "| comparison | official | jaxfl | key |", "|---|---|---|---|"]
    lines += [f"| {c.name} | `{c.official}` | `{c.jaxfl}` | {c.key} |" for c, _ in paired]
    lines += ["", "## Not paired", ""]
    lines += [f"- **{c.name}** (`{c.doc}`; unpaired criterion: {c.unpaired}): {r['error']}. {sentence(c.note)}"
              for c, r in unpaired]
    lines += [f"- **{name}** (`{doc}`): {reason}." for name, doc, reason in NOT_RUNS]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Write the markdown file (``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/official/paired.md", help="the markdown file to write")
    p.add_argument("--margin", type=float, default=1.5, help="equivalence margin in accuracy points (default 1.5)")
    p.add_argument("--last-k", type=int, default=5, help="evaluations averaged per seed (default 5)")
    args = p.parse_args(argv)
    text = report(args)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
