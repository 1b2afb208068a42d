"""Run an experiment end to end: data, model, algorithm, jitted rounds, evaluation, logging, checkpoints."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import numpy as np

from .algorithms import build_algorithm
from .config import RunConfig, check_output, clear_outputs, validate
from .data import load_dataset
from .distributed import client_mesh, is_primary
from .data.ragged import RaggedClients
from .engine import ClientData, LocalTrainer, client_optimizer, make_evaluate, normalizer
from .simulation import ClientStore, Simulation, make_block_evaluate, place_rows
from .errors import ConfigError, NonFiniteError
from .metrics import count_params
from .models import build_model

DEFAULT_MODEL = {"default": "digits_cnn", "digits": "digits_cnn", "pacs": "digits_cnn"}


def model_name(cfg: RunConfig) -> str:
    """--model, else the first model the algorithm allows, else the dataset's default (small_cnn otherwise)."""
    from .algorithms import options_class
    allowed = options_class(cfg.algorithm).models
    return cfg.model or (allowed[0] if allowed else DEFAULT_MODEL.get(cfg.dataset, "small_cnn"))
# Measured on a 2-core CPU (README, "Client strategies"): vmap of convolutions over per-client kernels
# lowers to slow grouped convolutions there, so CPU runs clients one after another inside the jit.
DEFAULT_STRATEGY = {"cpu": "map", "gpu": "vmap", "tpu": "vmap"}
# per-round (not per-client) metrics of Simulation.round, logged as they are
ROUND_METRICS = ("padded_work", "buckets", "compiled_shapes")


def default_strategy(backend: str | None = None) -> str:
    return DEFAULT_STRATEGY.get(backend or jax.default_backend(), "vmap")


@dataclasses.dataclass
class RunResult:
    """What a run returns: the config, client names, per-round history and the final states."""
    config: RunConfig
    client_names: list[str]
    history: list[dict]
    server: object
    clients: object
    num_params: int

    def summary(self) -> dict:
        return summarize(self.history, self.client_names)


def summarize(history: list[dict], names: list[str]) -> dict:
    """Last round, round with the best unweighted mean accuracy, and each client's best round.

    FL papers mix these up; they are reported under plain names:
    - ``last``: accuracies after the final round;
    - ``best_mean_round``: the single round whose unweighted mean over clients is highest;
    - ``best_per_client``: each client's own maximum over rounds (may come from different rounds).
    """
    evals = [h for h in history if "test_accuracy" in h]
    if not evals:
        return {}
    acc = np.array([h["test_accuracy"] for h in evals])
    best = int(np.argmax(acc.mean(1)))
    per_client_best = acc.max(0)
    return {
        "clients": names,
        "last": {"round": evals[-1]["round"], "accuracy": evals[-1]["test_accuracy"],
                 "mean_accuracy": evals[-1]["mean_accuracy"], "weighted_accuracy": evals[-1]["weighted_accuracy"]},
        "best_mean_round": {"round": evals[best]["round"], "accuracy": evals[best]["test_accuracy"],
                            "mean_accuracy": evals[best]["mean_accuracy"],
                            "weighted_accuracy": evals[best]["weighted_accuracy"]},
        "best_per_client": {"accuracy": per_client_best.tolist(), "mean_accuracy": float(per_client_best.mean())},
    }


class Experiment:
    """The build step of a run: data, model, algorithm, the jitted round and evaluation, built once from a
    config. ``run()`` (``train``, the host loop below) trains it to ``cfg.rounds``, resuming if asked."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg = validate(cfg)
        check_output(cfg)  # before any expensive work
        if cfg.devices > jax.device_count():
            raise ConfigError(f"devices={cfg.devices}: this machine has {jax.device_count()} "
                              f"{jax.default_backend()} device(s); use --devices 0 (all) or at most "
                              f"{jax.device_count()}")
        self.dataset = ds = load_dataset(cfg.data_config())
        n = len(ds.client_names)
        self.model = build_model(model_name(cfg), ds.num_classes)
        # devices != 1: the client axis is split over a mesh of that many devices (0: all of them); a
        # multi-process run (jaxfl.distributed.initialize) always uses every device of every process
        if jax.process_count() > 1 and cfg.devices not in (0, jax.device_count()):
            raise ConfigError(f"devices={cfg.devices}: a run over {jax.process_count()} processes splits the "
                              f"clients over all {jax.device_count()} devices; use devices=0")
        self.mesh = None if cfg.devices == 1 else client_mesh(cfg.devices or None)
        self.cohort = cohort_size(cfg, n)
        if self.mesh is not None and self.cohort % self.mesh.devices.size:
            raise ConfigError(f"{self.cohort} clients per round cannot be split evenly over "
                              f"devices={self.mesh.devices.size}; use a cohort that is a multiple of it")
        self.eval_batch_size = eval_bs = min(cfg.eval_batch_size, int(max(len(y) for _, y in ds.test)))
        self.train_data, self.test_data = RaggedClients.from_clients(ds.train), RaggedClients.from_clients(ds.test)
        tx = client_optimizer(**cfg.client_training())
        preprocess = normalizer(*ds.normalize)
        self.trainer = LocalTrainer(tx, cfg.batch_size, cfg.local_epochs, preprocess, lr=cfg.lr)
        self.options = cfg.algorithm_options()  # typed, presets applied (``RunConfig.resolved`` saves them)
        self.algorithm = build_algorithm(cfg.algorithm, self.model, self.trainer, self.options, num_clients=n)
        self.strategy = strategy = cfg.strategy or default_strategy()
        self.simulation = Simulation(self.algorithm, self.train_data, batch_size=cfg.batch_size, strategy=strategy,
                                     chunk_size=cfg.chunk_size, cohort_size=self.cohort, weighting=cfg.weighting,
                                     mesh=self.mesh, client_store=cfg.client_store, num_rounds=cfg.rounds)
        self.evaluate_fn = make_block_evaluate(self.algorithm, self.test_data, eval_batch_size=eval_bs,
                                               preprocess=preprocess, strategy=strategy, chunk_size=cfg.chunk_size,
                                               mesh=self.mesh, train=self.train_data)
        self.root = jax.random.key(cfg.seed)
        self.evaluate_trained_fn = None
        if cfg.eval_point == "local":  # the models right after local training, before aggregation
            if self.algorithm.predict_trained is None:
                raise ConfigError(f"--eval-point local: {cfg.algorithm} has no prediction of a just-trained model")
            if self.cohort != n:
                raise ConfigError("--eval-point local evaluates every client right after its local training, so "
                                  "every client must train every round (drop --clients-per-round/--participation)")
            self.evaluate_trained_fn = jax.jit(make_evaluate(
                self.algorithm._replace(predict=self.algorithm.predict_trained), eval_batch_size=eval_bs,
                preprocess=preprocess, strategy=strategy, chunk_size=cfg.chunk_size, mesh=self.mesh))

    def round_fn(self, server, store, round_idx, before_aggregate=None):
        """One training round (``Simulation.round``): (server, per-client and per-round metrics)."""
        return self.simulation.round(server, store, round_idx, self.root, before_aggregate=before_aggregate)

    @functools.cached_property
    def test(self) -> ClientData:
        """Every client's test set padded to the largest (for reports over stacked clients)."""
        return place_rows(self.test_data.stacked(self.eval_batch_size), self.mesh)

    def init(self):
        """(server, store): the initial server state and the per-client store."""
        # the init needs only an input's shape: the first client's first image (every process has it)
        return self.simulation.init(jax.random.fold_in(self.root, 2), self.dataset.train[0][0][:1])

    def evaluate(self, server, clients) -> dict:
        """Test metrics of every client; ``clients`` is a ClientStore or the stacked persistent states."""
        store = clients if isinstance(clients, ClientStore) else ClientStore(clients, "host")
        return eval_record(self.evaluate_fn(server, store))

    def evaluate_trained(self, server, trained) -> dict:
        """Test metrics of every client's model right after its local training (``trained``: the round's
        rows of every client, stacked in client order; ``eval_point="local"``)."""
        return eval_record(self.evaluate_trained_fn(server, trained, self.test))

    def reliability(self, server, clients, key, **kw) -> dict:
        """``reliability.reliability_report`` of these states on this run's test sets (kw: noise_sigma, ...)."""
        from .reliability import reliability_report
        clients = place_rows(clients, self.mesh)  # the stacked states, split like the test sets
        train = None if self.algorithm.prepare_predict is None else place_rows(self.train_data.stacked(1), self.mesh)
        return reliability_report(self.algorithm, server, clients, self.test, key, preprocess=self.trainer.preprocess,
                                  eval_batch_size=self.eval_batch_size, strategy=self.strategy, train=train, **kw)

    def run(self, progress: bool = False, log=None) -> RunResult:
        """Train to ``cfg.rounds`` (resuming if asked): ``train(self, ...)``."""
        return train(self, progress=progress, log=log)


def eval_record(m) -> dict:
    """metrics.jsonl's test fields from per-client evaluation arrays (accuracy, loss, count, diagnostics)."""
    acc, cnt = np.asarray(m["accuracy"], float), np.asarray(m["count"], float)
    extra = {f"test_{k}": np.asarray(v, float).tolist() for k, v in m.items() if k not in ("accuracy", "loss", "count")}
    return {"test_accuracy": acc.tolist(), "test_loss": np.asarray(m["loss"], float).tolist(),
            "mean_accuracy": float(acc.mean()), "weighted_accuracy": float((acc * cnt).sum() / cnt.sum()), **extra}


# -- the host loop: rounds, checks, logging, checkpoints -----------------------------------------------------
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling jitted functions (jax.monitoring)."""
    if not getattr(compile_seconds, "listening", False):
        def listen(event, duration, **_):
            if event in COMPILE_EVENTS:
                _compile_seconds[0] += duration
        jax.monitoring.register_event_duration_secs_listener(listen)
        compile_seconds.listening = True
    return _compile_seconds[0]



def open_run(exp: Experiment):
    """(server, store, start_round, history, checkpointer or None): a fresh start, or the newest checkpoint
    of ``--out`` under ``--resume``; writes config.json and the kept metrics (primary process)."""
    cfg, server, store = exp.cfg, *exp.init()
    out = Path(cfg.out) if cfg.out else None
    if out is None:
        return server, store, 0, [], None
    if cfg.overwrite:
        clear_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    from .checkpoint import Checkpointer
    start, history = 0, []
    ckpt = Checkpointer(out / "checkpoints") if cfg.resume or cfg.checkpoint_every else None
    if cfg.resume:
        server, clients, start, history = ckpt.restore_latest(server, store.state, cfg.resolved(),
                                                              out / "metrics.jsonl")
        store.set(clients)
    if is_primary():
        (out / "config.json").write_text(json.dumps(cfg.resolved().to_dict(), indent=2))
        _rewrite_jsonl(out / "metrics.jsonl", history)
    return server, store, start, history, ckpt


def check_finite(metrics, names, round_idx: int, ckpt) -> None:
    """NonFiniteError naming the round (1-based) and the clients whose loss or state is not finite."""
    ids = np.asarray(metrics["client_id"])
    bad = [names[i] for i, ok in zip(ids, np.asarray(metrics["finite"])) if not ok]
    if bad:
        last = ckpt.latest_round() if ckpt else None
        kept = f"; last good checkpoint: round {last}" if last is not None else ""
        raise NonFiniteError(f"non-finite loss or parameters in round {round_idx + 1} on client(s) "
                             f"{', '.join(bad)}; lower --lr or check the data{kept}")


def round_record(metrics, names, round_idx: int) -> dict:
    """The metrics.jsonl record of a round's training: per trained client, and the per-round metrics."""
    ids = np.asarray(metrics["client_id"])
    return {"round": round_idx + 1, "clients_trained": [names[i] for i in ids],
            "train_loss": np.asarray(metrics["loss"], float).tolist(),
            "train_accuracy": np.asarray(metrics["accuracy"], float).tolist(),
            # algorithm-specific per-client metrics (e.g. FedSelect's personal_fraction)
            **{f"train_{k}": np.asarray(v, float).tolist() for k, v in metrics.items()
               if k not in ("loss", "accuracy", "seen", "finite", "client_id") + ROUND_METRICS},
            **{k: metrics[k] for k in ROUND_METRICS}}


def train(exp: Experiment, progress: bool = False, log=None) -> RunResult:
    """The host loop of a built experiment: each round trains, checks for NaN, evaluates every
    ``eval_every`` rounds and at the end, appends to metrics.jsonl, checkpoints every ``checkpoint_every``
    rounds; at the end writes summary.json and accuracy.png (``--out``, primary process)."""
    cfg, names = exp.cfg, exp.dataset.client_names
    server, store, start, history, ckpt = open_run(exp)
    out = Path(cfg.out) if cfg.out else None
    write = out is not None and is_primary()  # every process checkpoints its rows; one logs
    bar = _progress(range(start, cfg.rounds), progress, start, cfg.rounds)
    for r in bar:
        t0, c0 = time.perf_counter(), compile_seconds()
        evaluate_now, local = (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds, {}
        hook = None
        if evaluate_now and cfg.eval_point == "local":  # the models right after local training
            hook = lambda s, trained, ids: local.update(exp.evaluate_trained(s, trained))
        server, m = exp.round_fn(server, store, r, before_aggregate=hook)
        check_finite(m, names, r, ckpt)
        rec = round_record(m, names, r)
        if evaluate_now:
            rec.update(local or exp.evaluate(server, store))
        rec["time_s"] = time.perf_counter() - t0
        rec["compile_s"] = compile_seconds() - c0  # part of time_s: tracing and compiling new shapes
        history.append(rec)
        if write:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        if ckpt and cfg.checkpoint_every and ((r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds):
            ckpt.save(r + 1, server, store.state)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{np.mean(rec['train_loss']):.3f}",
                            acc=f"{rec.get('mean_accuracy', float('nan')):.3f}")
        if log:
            log(rec)
    result = RunResult(cfg, names, history, server, store.state, count_params(server["params"]))
    if write:
        (out / "summary.json").write_text(json.dumps(result.summary(), indent=2))
        if history:
            plot_accuracy(history, names, out / "accuracy.png",
                          title=f"{cfg.algorithm} on {cfg.dataset}, {model_name(cfg)}, lr {cfg.lr}, seed {cfg.seed}")
    return result


def cohort_size(cfg: RunConfig, n: int) -> int:
    """Clients per round from ``clients_per_round`` or ``participation`` (a fraction), default all."""
    if cfg.clients_per_round is not None and cfg.participation is not None:
        raise ConfigError("give clients_per_round or participation, not both")
    if cfg.clients_per_round is not None:
        if cfg.clients_per_round > n:
            raise ConfigError(f"clients_per_round={cfg.clients_per_round} exceeds the {n} clients")
        return cfg.clients_per_round
    if cfg.participation is not None:
        return max(1, math.ceil(cfg.participation * n))
    return n


def run(cfg: RunConfig, progress: bool = False) -> RunResult:
    """Build and run an experiment."""
    return Experiment(cfg).run(progress=progress)


def _progress(it, enabled, start, total):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, initial=start, total=total, desc="round", unit="round")


def _rewrite_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def plot_accuracy(history, names, path, title=""):
    """PNG: each client's test accuracy per round (thin) and the unweighted mean (thick)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    evals = [h for h in history if "test_accuracy" in h]
    rounds = [h["round"] for h in evals]
    acc = np.array([h["test_accuracy"] for h in evals])
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(7.5, 4))
    markers = "os^vD<>pXh"
    few = len(names) <= 12  # more clients: thin unlabelled lines, the mean stands out
    for j, name in enumerate(names):
        ax.plot(rounds, acc[:, j], lw=1 if few else 0.5, alpha=0.8 if few else 0.3,
                marker=markers[j % len(markers)] if few else None, ms=3, label=name if few else None)
    ax.plot(rounds, acc.mean(1), lw=2.5, color="k", marker="o", ms=4, label="mean over clients")
    ax.set(xlabel="round", ylabel="test accuracy", title=title, ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the curves
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
