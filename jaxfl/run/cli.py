"""Command line: ``jaxfl run --algorithm NAME --dataset NAME [options]`` (``jaxfl run --help``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..errors import ConfigError, JaxflError, NonFiniteError, RunIOError, Stopped
from .signals import failpoint, signal_name, stop_signals
from .compile_cache import cache_warnings, resolve_compile_cache, use_compile_cache
from .config import (CONFIG_GROUPS, TRAINING_DEFAULTS, RunConfig, check_output, config_toml, holds_files,
                     load_config_file, validate)
from .checkpoint import saved_settings
from .script import check_output_file


def _numbers(text: str) -> tuple:
    """"0,0.2,0.4" -> (0.0, 0.2, 0.4): a tuple option's flag value."""
    return tuple(float(x) for x in text.split(","))


_numbers.__name__ = "comma-separated numbers"  # (argparse: "invalid comma-separated numbers value: '0,abc'")


def _add_flag(group, flag: str, dest: str, tp, text: str) -> None:
    if tp is bool:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=text)
    elif tp is tuple:  # comma-separated numbers, e.g. --dapperfl.device-ratios 0,0.2,0.4
        group.add_argument(flag, dest=dest, type=_numbers, help=text)
    else:
        group.add_argument(flag, dest=dest, type=tp, help=text)


def generated_help() -> dict[str, str]:
    """Help texts built from the registries: every algorithm, model and dataset by name, and each protocol
    field's default (the algorithms' ``train_preset`` values, else ``TRAINING_DEFAULTS``)."""
    from ..algorithms import REGISTRY
    from ..data.federated import DATASET_NAMES
    from ..models import MODELS
    declared = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(RunConfig)}
    out = {"algorithm": " | ".join(REGISTRY), "model": " | ".join(MODELS) + " (default: per dataset)",
           "dataset": " | ".join(n + " (embedded, offline)" if n == "default" else n for n in DATASET_NAMES)}
    for field, default in TRAINING_DEFAULTS.items():
        own = [f"{name} {reg.options.train_preset[field]}" for name, reg in REGISTRY.items()
               if field in reg.options.train_preset]
        text = f"default: {default}" + (f"; the official protocol for {', '.join(own)}" if own else "")
        out[field] = "; ".join(s for s in (declared[field], text) if s)
    return out


LAUNCH_OPTIONS = ("coordinator_address", "num_processes", "process_id")
PROCESS_OPTIONS = ("quiet", "print_config", "compile_cache", "seeds") + LAUNCH_OPTIONS  # the process's, not a run's


class UsageError(Exception):
    """A command line argparse refuses (unknown or ambiguous flag, a value of the wrong type)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a refused command line raises UsageError (``main`` prints one line) instead of printing
    the whole usage (~170 lines with every algorithm's options) and exiting. Flags must be spelled in full:
    an abbreviation that works today would become ambiguous when an algorithm adds an option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxfl", description="Vectorized personalized federated learning.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="runs side by side: one table and one figure, seeds grouped")
    cmp.add_argument("runs", nargs="+", metavar="RUN_DIR",
                     help="run folders (holding metrics.jsonl), or folders searched for them")
    cmp.add_argument("--key", default="mean_accuracy",
                     help="mean_accuracy (unweighted over clients) | weighted_accuracy (by test-set size); "
                          "either with the prefix global_ (runs with --eval-model both), new_ or new_tuned_ (the "
                          "held-out clients of --new-clients, with the global model or after a local update)")
    cmp.add_argument("--last-k", type=int, default=5, help="the last-k column averages the last k evaluations")
    cmp.add_argument("--per-client", action="store_true", help="also each client's final accuracy")
    cmp.add_argument("--spread", action="store_true", help="also how the final accuracy spreads over the "
                                                           "clients: its 10th percentile and the worst 10%% mean")
    cmp.add_argument("--md", help="write the markdown table here")
    cmp.add_argument("--csv", help="write the table as CSV here")
    cmp.add_argument("--plot", help="write the figure (PNG) here: mean accuracy per round, ± std over seeds")
    cmp.add_argument("--title", default="", help="the figure's title")
    cmp.add_argument("--paired", action="store_true",
                     help="the paired equivalence test of two sides run on the same seeds: give two RUN_DIRs (or "
                          "quoted patterns such as 'DIR/seed*/NAME'), one run per seed each; per seed the difference "
                          "of the last-k means, their mean, its t-interval and the verdict against --margin; --plot "
                          "draws the per-round difference")
    cmp.add_argument("--margin", type=float, default=1.5,
                     help="--paired: equivalence margin in accuracy points, stated before the runs (default 1.5)")
    cmp.add_argument("--level", type=float, default=0.9,
                     help="--paired: the confidence level of the t-interval (default 0.9: TOST at 5%%)")
    run = sub.add_parser("run", help="train and evaluate one configuration",
                         argument_default=argparse.SUPPRESS)
    run.add_argument("--config", help="TOML or JSON file of options; flags override it")
    run.add_argument("--quiet", action="store_true", help="no progress bar or table")
    run.add_argument("--print-config", action="store_true",
                     help="print the run's whole configuration as a TOML file (--config reads it back: every value, "
                          "presets and the algorithm's options filled in, grouped) and exit; nothing is loaded or "
                          "written")
    run.add_argument("--seeds", metavar="S,S,...",
                     help="one run per seed, one after another, into OUT/seed<S> (OUT: --out or a new runs/... "
                          "folder), then the table of `jaxfl compare` (mean ± std over the seeds) on stdout and in "
                          "OUT/compare.md, and its figure in OUT/compare.png; with --resume, each seed continues "
                          "(or starts) its own run")
    run.add_argument("--compile-cache", metavar="DIR",
                     help="keep compiled programs in DIR for later runs of the same shapes (a sweep's other seeds "
                          "and rates), or none; the same numbers either way (default: $JAXFL_COMPILE_CACHE, else "
                          "~/.cache/jaxfl/xla; jax's own JAX_COMPILATION_CACHE_DIR, if set, is kept)")
    launch = run.add_argument_group("multi-process launch (one process per host; see docs/design.md, Scale-out)")
    launch.add_argument("--coordinator-address", help="host:port of process 0, the same for every process")
    launch.add_argument("--num-processes", type=int, help="processes in the run (default 1)")
    launch.add_argument("--process-id", type=int, help="this process's index in [0, num_processes)")
    from ..algorithms import REGISTRY
    from ..core.options import field_type
    generated = generated_help()
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for group, names in CONFIG_GROUPS.items():  # --help lists the options by what they set
        section = run.add_argument_group(f"{group} options")
        for name in names:
            f = fields[name]
            default = f"default: {f.default}" if f.default is not None else ""
            text = "; ".join(s for s in (generated.get(name, f.metadata.get("help", "")), default) if s)
            _add_flag(section, "--" + f.name.replace("_", "-"), f.name, field_type(RunConfig, f),
                      text.replace("%", "%%"))
    for name, reg in REGISTRY.items():  # --NAME.OPTION, e.g. --fedselect.alpha 0.5
        cls = reg.options
        if not cls.fields():
            continue
        shares, keeps = cls.sharing
        group = run.add_argument_group(f"{name} options", f"shares {shares}; keeps {keeps}".replace("%", "%%"))
        for f in cls.fields():
            default = f"default: {f.default}" if f.default is not None else ""
            text = "; ".join(s for s in (f.metadata.get("help", ""), default) if s).replace("%", "%%")
            _add_flag(group, f"--{name}.{f.name.replace('_', '-')}", f"{name}.{f.name}", field_type(cls, f), text)
    return parser


def config_values(args: dict) -> dict:
    """Parsed flags -> a config dict: RunConfig fields, and ``--NAME.OPTION`` flags as tables by algorithm."""
    values = {k: v for k, v in args.items() if "." not in k}
    for key, v in args.items():
        if "." in key:
            name, field = key.split(".", 1)
            values.setdefault(name, {})[field] = v
    return values


def merge_config(file_values: dict, flag_values: dict) -> dict:
    """A config file's values overridden by the flags' (algorithm tables merged option by option)."""
    merged = dict(file_values)
    for k, v in flag_values.items():
        merged[k] = {**merged.get(k, {}), **v} if isinstance(v, dict) else v
    return merged


MAX_LISTED_CLIENTS = 20  # past this, the start-up line and the final table summarise the clients


def format_table(summary: dict) -> str:
    """Plain-text per-client table: last round, best-mean round, each client's best; past
    ``MAX_LISTED_CLIENTS`` clients, their min / median / max instead of a row each (summary.json has them all)."""
    import numpy as np
    names = summary["clients"]
    last, best, own = summary["last"], summary["best_mean_round"], summary["best_per_client"]
    many = len(names) > MAX_LISTED_CLIENTS
    w = max(12, max(len(n) for n in names) + 2) if not many else 16
    head = (f"{'client':<{w}}{'last (r' + str(last['round']) + ')':>14}"
            f"{'best-mean (r' + str(best['round']) + ')':>20}{'own best':>12}")
    rows = [head, "-" * len(head)]
    cols = [np.asarray(c["accuracy"], float) for c in (last, best, own)]
    listed = ([(f"{stat} of {len(names)}", [fn(c) for c in cols]) for stat, fn in
               (("min", np.nanmin), ("median", np.nanmedian), ("max", np.nanmax))] if many else
              [(n, [c[j] for c in cols]) for j, n in enumerate(names)])
    num = lambda v, width: f"{'-':>{width}}" if v is None or v != v else f"{v:>{width}.4f}"  # noqa: E731
    for n, (a, b, c) in listed:
        rows.append(f"{n:<{w}}{num(a, 14)}{num(b, 20)}{num(c, 12)}")
    rows.append("-" * len(head))
    rows.append(f"{'mean':<{w}}{num(last['mean_accuracy'], 14)}{num(best['mean_accuracy'], 20)}"
                f"{num(own['mean_accuracy'], 12)}")
    rows.append(f"{'weighted':<{w}}{num(last['weighted_accuracy'], 14)}{num(best['weighted_accuracy'], 20)}"
                f"{'':>12}")
    for key, label in (("global", "global model"), ("new", "new, global"), ("new_tuned", "new, tuned")):
        if key in summary:  # the last evaluation's mean of the other models and clients
            rows.append(f"{label:<{w}}{num(summary[key]['mean_accuracy'], 14)}")
    return "\n".join(rows)


def compare_main(args: dict) -> int:
    """``jaxfl compare``: the markdown table on stdout; --md/--csv/--plot files."""
    from .compare import compare, plot_mean_accuracy
    from .plots import IMAGE_FORMATS
    if args["paired"]:
        return paired_main(args)
    notes = []
    try:
        outputs = [(args[k], k) for k in ("md", "csv", "plot") if args[k]]
        for path, kind in outputs:  # checked before any is written
            check_output_file(path, f"--{kind}")
            if kind == "plot":
                if Path(path).suffix.lower().lstrip(".") not in IMAGE_FORMATS:
                    raise ConfigError(f"--plot {path!r}: give a file ending in one of "
                                      f"{', '.join('.' + f for f in IMAGE_FORMATS)}")
                check_plotting("--plot")
        results, table, csv_text = compare(args["runs"], args["key"], args["last_k"], args["per_client"], notes,
                                           spread=args["spread"])
    except JaxflError as e:
        print(f"jaxfl: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"jaxfl: note: {note}", file=sys.stderr)
    print(table)
    for path, kind in outputs:
        try:
            if kind == "md":
                Path(path).write_text(table + "\n")
            elif kind == "csv":
                Path(path).write_text(csv_text)
            else:
                plot_mean_accuracy(results, Path(path), args["title"], key=args["key"])
        except OSError as e:
            print(f"jaxfl: error: could not write {path!r} ({e.strerror or e})", file=sys.stderr)
            return 1
    return 0


def check_plotting(flag: str) -> None:
    """ConfigError unless matplotlib imports (a declared dependency that a bare environment may lack)."""
    from .plots import plotting_available
    if not plotting_available():
        raise ConfigError(f"{flag} needs matplotlib, which is not installed (pip install matplotlib)")


def paired_main(args: dict) -> int:
    """``jaxfl compare A B --paired``: the paired equivalence table on stdout; --md/--plot files."""
    from .compare import paired_equivalence, paired_table, plot_paired_curve, runs_by_seed
    try:
        if len(args["runs"]) != 2:
            raise ConfigError(f"--paired compares two sides: give two RUN_DIRs (or quoted patterns), got "
                              f"{len(args['runs'])}")
        if args["csv"] or args["per_client"]:
            raise ConfigError("--paired writes --md and --plot; --csv and --per-client are for the grouped table")
        for kind in ("md", "plot"):
            if args[kind]:
                check_output_file(args[kind], f"--{kind}")
        if args["plot"]:
            check_plotting("--plot")
        a, b = (runs_by_seed(p) for p in args["runs"])
        result = paired_equivalence({s: h for s, (_, h) in a.items()}, {s: h for s, (_, h) in b.items()},
                                    args["key"], args["last_k"], args["margin"], args["level"])
    except JaxflError as e:
        print(f"jaxfl: error: {e}", file=sys.stderr)
        return 2
    table = paired_table(result, *args["runs"])
    print(table)
    try:
        if args["md"]:
            Path(args["md"]).write_text(table + "\n")
        if args["plot"]:
            plot_paired_curve(result, Path(args["plot"]), args["title"], *args["runs"])
    except OSError as e:
        print(f"jaxfl: error: could not write ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    try:
        args = vars(build_parser().parse_args(argv))
    except UsageError as e:
        argv = sys.argv[1:] if argv is None else list(argv)
        command = next((a for a in argv[:1] if a in ("run", "compare")), None)
        print(f"jaxfl: error: {e} ({'jaxfl ' + command if command else 'jaxfl'} --help lists the options)",
              file=sys.stderr)
        return 2
    if args.pop("command") == "compare":
        return compare_main(args)
    quiet = args.pop("quiet", False)
    print_config = args.pop("print_config", False)
    cache_flag = args.pop("compile_cache", None)
    seeds_flag = args.pop("seeds", None)
    launch = {k: args.pop(k) for k in LAUNCH_OPTIONS if k in args}
    from ..core.distributed import check_launch, check_same_everywhere, initialize, is_primary  # (imports jax)
    seed = None
    try:
        check_launch(*(launch.get(k) for k in LAUNCH_OPTIONS))
        processes = launch.get("num_processes") or 1
        # bad input is refused before joining the other processes (which would wait for a peer that has left)
        root, cfgs, skip = (None, [run_config(args)], ()) if seeds_flag is None else seed_configs(args, seeds_flag)
        if print_config:  # (a sweep's seeds differ in the seed and the folder only: the first one's)
            print(config_toml(validate(cfgs[0]).resolved()), end="")
            return 0
        if processes > 1:
            for c in cfgs:
                validate(c)  # Experiment validates too, but after joining, a refusal would leave a peer waiting
            if any(c.devices not in (0, None) for c in cfgs):
                raise ConfigError(f"--num-processes {processes}: a run over several processes splits the clients over "
                                  f"all of their devices; drop --devices {cfgs[0].devices} (or give 0)")
            initialize(launch["coordinator_address"], processes, launch["process_id"])
            quiet = quiet or not is_primary()  # one process prints
            check_same_everywhere({**cfgs[0].to_dict(), "seeds": [c.seed for c in cfgs]})
        folder, named, note = resolve_compile_cache(cache_flag)
        cache = use_compile_cache(folder, explicit=named)
        if cache is None and note and not quiet:
            say(note)
        diverged = []  # --seeds: a seed whose training turned NaN/Inf; the sweep goes on without it
        todo = [c for c in cfgs if c.seed not in skip]
        between = False  # the sweep stopped between two seeds (not inside one seed's run)
        # a stop signal is recorded from here on and honoured where nothing is lost: before round 1, after a
        # round's checkpoint, between seeds; one arriving during a summary or plot lets it finish
        with cache_warnings(cache, say), stop_signals() as stop:
            for i, cfg in enumerate(todo):
                seed = cfg.seed
                if i:
                    failpoint("seed")
                if stop:
                    between = True
                    raise Stopped(f"stopped before seed {seed}, seed(s) {', '.join(str(c.seed) for c in todo[:i])} "
                                  f"done", stop[0], None)
                try:
                    result = run_one(cfg, quiet, cache, stop)
                except NonFiniteError as e:
                    if root is None:
                        raise
                    say(f"error: seed {seed}: {e}")
                    diverged.append(seed)
                    continue
                summary = result.summary()
                if root is None and summary and is_primary():
                    print(format_table(summary) if not quiet else json.dumps(summary["last"]))
            done = [c.out for c in cfgs if c.seed not in diverged]
            table = seeds_table(root, done) if root is not None and done and is_primary() else None
            late = list(stop)  # a signal during the last run's summary or the sweep's table: all is written
    except Stopped as e:  # SIGTERM/SIGINT: the run is checkpointed at a round boundary
        if root is None:
            say(str(e))
        else:
            where = (e.where if between else f"{e.where} of seed {seed}" if e.round_done is not None
                     else f"seed {seed}: {e.where}")
            if any(Path(root).glob("seed*/config.json")):  # a started seed's config.json holds the settings
                say(f"{where}; continue with jaxfl run --out {root} --seeds {seeds_flag} --resume")
            else:  # (a resume would have no settings but its flags: the command itself starts the sweep again)
                say(f"{where}; no seed had started, nothing was written: run the command again")
        return e.exit_code
    except JaxflError as e:  # bad input: exit 2; a failed write (RunIOError): exit 1
        say(f"error: {e}")
        return e.exit_code
    if table is not None:
        print(table)
    if late:
        say(f"{signal_name(late[0])} arrived as the {'sweep' if root is not None else 'run'} finished; "
            f"{'every seed' if root is not None else 'it'} is complete and written")
    if root is not None and diverged:
        say(f"error: seed(s) {', '.join(map(str, diverged))} stopped on non-finite numbers (above); "
            + (f"the table covers the other {len(done)}" if done else "no seed finished"))
        return NonFiniteError.exit_code
    return 0


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2]; ConfigError unless distinct integers >= 0."""
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds {text!r}: give distinct integers >= 0, comma-separated, e.g. 0,1,2")
    return seeds


def seed_configs(args: dict, seeds_flag: str) -> tuple[str, list[RunConfig], set[int]]:
    """(OUT, the validated config of each seed's run in OUT/seed<S>, the seeds whose runs are already finished),
    all checked before any run starts. Under --resume a seed whose folder is missing or empty starts its run,
    and a finished one is skipped."""
    seeds = parse_seeds(seeds_flag)
    if "seed" in args:
        raise ConfigError(f"--seed {args['seed']} and --seeds {seeds_flag}: give one of them")
    # OUT: the flag, else the config file's ``out``, else a new folder (not under --resume)
    root = args.get("out") or (load_config_file(args["config"]).get("out") if args.get("config") else None)
    if args.get("resume") and not root:
        raise ConfigError(f"--seeds {seeds_flag} --resume: give the --out of the runs to continue")
    root = root or run_config({k: v for k, v in args.items() if k != "resume"}).out
    # under --resume a seed not started yet takes the sweep's settings from a started one's config.json
    started = sorted(Path(root).glob("seed*/config.json")) if args.get("resume") else []
    if args.get("resume"):  # as for one run: a resume needs a sweep that has started (its settings are saved)
        if not Path(root).is_dir():
            raise ConfigError(f"--resume: {str(root)!r} does not exist: no sweep to continue (drop --resume to "
                              f"start it)")
        if not started:
            raise ConfigError(f"--resume: no seed in {str(root)!r} has started (no seed<S>/config.json): no sweep "
                              f"to continue (drop --resume to start it)")
    if (Path(root) / "metrics.jsonl").exists() or (Path(root) / "config.json").exists():
        raise ConfigError(f"--out {str(root)!r} holds a run of its own; --seeds writes one run per seed into "
                          f"{str(root)!r}/seed<S>: choose another folder")
    cfgs, skip = [], set()
    for seed in seeds:
        out = Path(root) / f"seed{seed}"
        resume = bool(args.get("resume")) and out.is_dir() and holds_files(out)
        cfg = validate(run_config({**args, "seed": seed, "out": str(out), "resume": resume},
                                  like=started[0] if started and not resume else None))
        if resume and finished(cfg):  # a finished seed needs no checkpoint to be resumed
            skip.add(seed)
        else:
            check_output(cfg)
        cfgs.append(cfg)
    return str(root), cfgs, skip


def finished(cfg: RunConfig) -> bool:
    """Whether ``cfg.out`` holds a run that has reached ``cfg.rounds`` (its summary written)."""
    log, summary = Path(cfg.out) / "metrics.jsonl", Path(cfg.out) / "summary.json"
    try:
        lines = log.read_text().splitlines()
        return summary.is_file() and bool(lines) and json.loads(lines[-1])["round"] == cfg.rounds
    except (OSError, ValueError, KeyError):
        return False


def seeds_table(root: str, outs: list[str]) -> str:
    """The ``jaxfl compare`` table of a --seeds run's folders, also written to ROOT/compare.md, with the mean
    accuracy per round (± one std over the seeds) in ROOT/compare.png."""
    from .compare import compare, plot_mean_accuracy
    from .plots import plotting_available
    results, table, _ = compare(outs)
    try:
        (Path(root) / "compare.md").write_text(table + "\n")
        if plotting_available():  # (without matplotlib each run said its figure was not drawn)
            plot_mean_accuracy(results, Path(root) / "compare.png", f"{len(outs)} seeds")
    except OSError as e:
        raise RunIOError(f"writing {root}/compare.md or compare.png: {e}; the runs are complete (jaxfl compare "
                         f"{root} redoes the table)") from None
    return table


def run_one(cfg: RunConfig, quiet: bool, cache: str | None, stop=()):
    """Build and train one run, with the start-up line, a progress bar (a terminal) or one line per round.
    ``stop``: the stop-signal record (``signals.stop_signals``); a signal that came while the data loaded
    stops the run before anything is written."""
    from .runner import Experiment
    failpoint("load")
    exp = Experiment(cfg)
    if stop:
        again = f"continue with jaxfl run --out {cfg.out} --resume" if cfg.resume else "run the command again"
        where = "stopped while loading, before round 1"
        raise Stopped(f"{where}; nothing was written: {again}", stop[0], None, where)
    if not quiet:
        population = population_note(exp.dataset.client_names, exp.dataset.train_counts())
        lanes = getattr(exp.backend, "lanes", None)
        plan = "" if lanes is None else " (" + " + ".join(
            f"{c} chunk{'s' if c > 1 else ''} of {n} lane{'s' if n > 1 else ''}" for n, c in lanes.segments) + ")"
        print(f"jaxfl: {cfg.algorithm} on {cfg.dataset}: {population}, strategy {exp.strategy}{plan}, backend "
              f"{exp.backend_name}, {devices_note(exp)}, compile cache {cache or 'off'}; writing to {cfg.out}",
              file=sys.stderr)
        if exp.dataset.task == "multilabel":
            print(f"jaxfl: {cfg.dataset} is a multi-label task ({exp.dataset.num_classes} labels): its loss is the "
                  f"per-label binary cross-entropy and its 'accuracy' the recall@5 averaged over samples",
                  file=sys.stderr)
        elif exp.dataset.task == "reconstruction":
            print(f"jaxfl: {cfg.dataset} is a reconstruction task ({exp.dataset.num_classes} targets a sample): its "
                  f"loss is the mean squared error of the sigmoid outputs and its 'accuracy' 1 - that error",
                  file=sys.stderr)
        if exp.privacy is not None:
            adapt = "" if cfg.dp_quantile is None else (f" (at first; then the {cfg.dp_quantile:g} quantile of the "
                                                        f"update norms, lr {cfg.dp_clip_lr:g})")
            calibrated = "" if cfg.dp_epsilon is None else f" (the noise calibrated to epsilon {cfg.dp_epsilon:g})"
            what = ("DP-SGD: each sample's gradient clipped to norm" if cfg.dp_level == "sample"
                    else "DP-FedAvg: updates clipped to norm")
            say(f"{what} {cfg.dp_clip:g}{adapt}, {exp.privacy.describe(cfg.rounds)}{calibrated}")
    bar = not quiet and sys.stderr.isatty()  # piped: one plain line per round instead of a progress bar
    result = exp.run(progress=bar, log=None if quiet or bar else print_round(cfg.rounds), notify=say)
    if not quiet:
        figure = ", accuracy.png" if (Path(cfg.out) / "accuracy.png").is_file() else ""
        print(f"wrote {cfg.out}/metrics.jsonl, summary.json{figure}", file=sys.stderr)
    return result


def population_note(names: list[str], counts) -> str:
    """"3 clients ['a', 'b', 'c'], train sizes [7, 8, 9]"; past ``MAX_LISTED_CLIENTS`` clients, the first and
    last names and the sizes' range and median."""
    import numpy as np
    counts = np.asarray(counts)
    if len(names) <= MAX_LISTED_CLIENTS:
        return f"{len(names)} clients {names}, train sizes {counts.tolist()}"
    return (f"{len(names)} clients ({names[0]} ... {names[-1]}), train sizes {counts.min()}-{counts.max()} "
            f"(median {np.median(counts):g})")


def say(line: str) -> None:
    """One ``jaxfl: ...`` line on stderr (a run's notices: a checkpoint fallback, a compile-cache fault)."""
    print(f"jaxfl: {line}", file=sys.stderr, flush=True)


def command_config(argv) -> RunConfig:
    """The RunConfig of a ``jaxfl run ...`` command line (``argv``: what follows ``jaxfl``) as ``main`` builds
    it, process flags (``PROCESS_OPTIONS``) aside; nothing runs. Raises UsageError or ConfigError."""
    args = vars(build_parser().parse_args(argv))
    if args.pop("command") != "run":
        raise UsageError(f"{argv[0]!r} is not `jaxfl run`")
    for k in PROCESS_OPTIONS:
        args.pop(k, None)
    return run_config(args)


def run_config(args: dict, like: Path | None = None) -> RunConfig:
    """The validated RunConfig of parsed ``jaxfl run`` arguments (``vars(parse_args(...))`` less
    ``PROCESS_OPTIONS``): the config file, then the flags, over the saved config of ``--out`` under
    ``--resume`` (or of ``like``: ``with_saved_run``). Raises ConfigError on bad input; builds nothing."""
    args = dict(args)
    flags = config_values(args)
    values = merge_config(load_config_file(args.pop("config")) if "config" in args else {}, flags)
    values.pop("config", None)
    values = with_saved_run(values, like)
    if values.get("out") is None and not values.get("resume"):  # (an empty --out is refused by check_output)
        values["out"] = default_out(values)
    cfg = RunConfig.from_dict(values)
    other = sorted(k for k, v in flags.items() if isinstance(v, dict) and k != cfg.algorithm)
    if other:
        opts = ", ".join(f"--{k}.{f.replace('_', '-')}" for k in other for f in flags[k])
        raise ConfigError(f"{opts}: option(s) of {', '.join(other)}, but the algorithm is {cfg.algorithm} "
                          f"(its options are --{cfg.algorithm}.NAME)")
    return cfg


def devices_note(exp) -> str:
    """How many devices the run's clients are split over, and on a CPU with idle cores a hint to use them (each
    core then trains its block of the cohort: 1.6-2.7x for small models on 2 cores, EPYC and Xeon,
    benchmarks/RESULTS.md)."""
    from ..core.distributed import cpu_cores
    from .build import platform
    n = 1 if exp.mesh is None else exp.mesh.devices.size
    cores = cpu_cores()
    if n == 1 and platform() == "cpu" and cores > 1 and exp.cohort % cores == 0 and exp.cfg.devices == 1:
        return f"1 device (--devices {cores} would split each cohort over this CPU's {cores} cores)"
    return f"{n} device{'s' if n > 1 else ''}"


def default_out(values: dict) -> str:
    """runs/<algorithm>-<dataset>-<local time>, made unique with a -2, -3, ... suffix."""
    import time
    from pathlib import Path
    dataset = str(values.get("dataset", "default")).replace(":", "-").replace("/", "_").strip("_") or "data"
    base = f"runs/{values.get('algorithm', 'fedbn')}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, i = base, 1
    while Path(out).exists():
        i += 1
        out = f"{base}-{i}"
    return out


def with_saved_run(values: dict, like: Path | None = None) -> dict:
    """Under --resume, the saved config of --out as the base, overridden by what the file and flags give; for a
    run not started yet, ``like`` (another run's config.json: a sweep's sibling seed) is the base instead."""
    saved_path = Path(values["out"]) / "config.json" if values.get("resume") and values.get("out") else None
    if saved_path is None or not saved_path.is_file():
        saved_path = like
    if saved_path is None:
        return values
    saved = saved_settings(saved_path)
    own = ("seed", "out") if saved_path == like else ()  # a sibling's seed and folder are its own
    saved = {k: v for k, v in saved.items() if k not in ("resume", "overwrite", *own)}
    if saved.get("dp_epsilon") is not None:
        # a --dp-epsilon run saved the target and the noise multiplier calibrated to it: --dp-noise given now
        # replaces both; else the target stays and is calibrated again (the same z over the same --rounds)
        saved.pop("dp_epsilon" if "dp_noise" in values else "dp_noise", None)
    return merge_config(saved, values)


def print_round(total: int):
    """A log callback: one plain line per round (for output that is not a terminal)."""
    def log(rec: dict) -> None:
        acc = f", mean test accuracy {rec['mean_accuracy']:.4f}" if "mean_accuracy" in rec else ""
        loss = sum(rec["train_loss"]) / max(len(rec["train_loss"]), 1)
        compile_s = rec.get("compile_s", 0.0)
        took = f"{rec['time_s']:.1f} s" + (f", of which compiling {compile_s:.1f} s" if compile_s >= 0.05 else "")
        print(f"round {rec['round']}/{total}: train loss {loss:.4f}{acc} ({took})", file=sys.stderr, flush=True)
    return log


def entry() -> None:
    """The ``jaxfl`` command: ``main``'s exit code; after a failed write (exit 1) the process's remaining
    stderr is dropped, so that background I/O threads (TensorStore's) cannot add tracebacks to the one line."""
    code = main()
    if code == 1:
        import os
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.exit(code)


if __name__ == "__main__":
    entry()
