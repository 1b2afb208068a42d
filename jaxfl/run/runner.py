"""Run an experiment end to end: data, model, algorithm, jitted rounds, evaluation, logging, checkpoints."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import numpy as np

from ..algorithms import build_algorithm
from ..core.distributed import is_primary
from ..core.evaluate import Evaluator
from ..core.metrics import client_spread
from ..core.step import cohort_train
from ..core.privacy import CLIP_KEY, value_noise_multiplier
from ..core.trainer import ClientOptimizer, LocalTrainer, normalizer
from ..core.trees import count_params
from ..core.types import RunContext
from ..data.ragged import RaggedClients
from ..errors import ConfigError, JaxflError, NonFiniteError, RunIOError, Stopped, first_line
from ..models import build_model
from ..ops.augment import make_augment
from .build import (backdoor_test_data, backend_for, build_trainer, check_cohort_memory, check_device_count,
                    client_placement, eval_batch_size, eval_tail_sizes, load_run_data, malicious_of, poison_data,
                    sample_dp_noise, server_side, start_devices, tail_batch_sizes, with_dp)
from .config import RunConfig, check_output, clear_outputs, dp_count_noise, model_name, replace_text, validate
from .evaluation import (TUNE_STREAM, InitialStates, holds_model, on_rows, prefixed, server_predict)
from .lock import RunLock
from .plots import plot_accuracy, plotting_available
from .signals import failpoint, stop_signals


def model_size(server, model, sample_x) -> int:
    """The parameter count of the server's model, or where the server holds none (FedProto, FedAMP's table) of
    ``model`` on a preprocessed sample ``sample_x`` (shapes only: nothing is computed)."""
    if "params" in server:
        return count_params(server["params"])
    return count_params(jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), sample_x)["params"])


# per-round (not per-client) metrics of a backend's round, logged as they are
ROUND_METRICS = ("padded_work", "buckets", "compiled_shapes", "host_share")


@dataclasses.dataclass
class RunResult:
    """What a run returns: the config, client names, per-round history and the final states (``new_clients``:
    the names of the clients held out of training, ``--new-clients``)."""
    config: RunConfig
    client_names: list[str]
    history: list[dict]
    server: object
    clients: object
    num_params: int
    new_clients: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> dict:
        return summarize(self.history, self.client_names, self.new_clients)


# the evaluation protocol's other models and clients (``jaxfl.run.evaluation``): their fields' prefixes
OTHER_EVALUATIONS = ("global_", "new_", "new_tuned_")


def summarize(history: list[dict], names: list[str], new_names: list[str] = ()) -> dict:
    """Last round, round with the best unweighted mean accuracy, and each client's best round.

    FL papers mix these up; they are reported under plain names:
    - ``last``: accuracies after the final round;
    - ``best_mean_round``: the single round whose unweighted mean over clients is highest;
    - ``best_per_client``: each client's own maximum over rounds (may come from different rounds; null for a
      client never evaluated).
    ``last.spread``: how the final accuracies spread over the clients (``core.metrics.client_spread``: std,
    10th/50th/90th percentiles, the worst 10%'s mean). A client not evaluated in a round (``--eval-clients
    cohort``) is null there and out of that round's means. The global model's and the held-out clients' final
    evaluations (``--eval-model both``, ``--new-clients``) are under ``global``, ``new`` and ``new_tuned``
    (``new_clients``: the held-out clients' names).
    """
    evals = [h for h in history if "test_accuracy" in h]
    if not evals:
        return {}
    acc = np.array([[np.nan if a is None else a for a in h["test_accuracy"]] for h in evals], float)
    means = [-np.inf if h["mean_accuracy"] is None else h["mean_accuracy"] for h in evals]
    best = int(np.argmax(means))
    per_client_best = np.where(np.isnan(acc), -np.inf, acc).max(0)
    seen = np.isfinite(per_client_best)
    out = {
        "clients": names,
        "last": {"round": evals[-1]["round"], "accuracy": evals[-1]["test_accuracy"],
                 "mean_accuracy": evals[-1]["mean_accuracy"], "weighted_accuracy": evals[-1]["weighted_accuracy"],
                 "spread": client_spread(evals[-1]["test_accuracy"])},
        "best_mean_round": {"round": evals[best]["round"], "accuracy": evals[best]["test_accuracy"],
                            "mean_accuracy": evals[best]["mean_accuracy"],
                            "weighted_accuracy": evals[best]["weighted_accuracy"]},
        "best_per_client": {"accuracy": [float(a) if ok else None for a, ok in zip(per_client_best, seen)],
                            "mean_accuracy": float(per_client_best[seen].mean()) if seen.any() else None},
    }
    for prefix in OTHER_EVALUATIONS:
        last = evals[-1]
        if prefix + "mean_accuracy" in last:
            out[prefix.rstrip("_")] = {"round": last["round"], "mean_accuracy": last[prefix + "mean_accuracy"],
                                       "weighted_accuracy": last[prefix + "weighted_accuracy"],
                                       "spread": client_spread(last[prefix + "test_accuracy"])}
    if new_names:
        out["new_clients"] = list(new_names)
    return out


class Experiment:
    """The build step of a run: data, model, algorithm, the jitted round and evaluation, built once from a
    config. ``run()`` (``train``, the host loop below) trains it to ``cfg.rounds``, resuming if asked."""

    def __init__(self, cfg: RunConfig):
        # the build, step by step (``jaxfl.run.build``): checks before any work, data, model, where the clients
        # run, local training, the algorithm, privacy; then the server's wrappers, the backend and evaluation
        start_devices(cfg)
        self.cfg = cfg = validate(cfg)
        check_output(cfg)  # before any expensive work
        if cfg.resume and cfg.out:  # the saved run's config and checkpoints, before any data is read
            from .checkpoint import check_resumable
            check_resumable(cfg.resolved(), Path(cfg.out))
        check_device_count(cfg)
        self.dataset, self.new_dataset = ds, _ = load_run_data(cfg)  # (new: --new-clients' held-out clients)
        n = len(ds.client_names)
        self.model = build_model(model_name(cfg), ds.num_classes)
        place = client_placement(cfg, n)
        self.cohort, self.rate, self.devices, self.mesh = place.cohort, place.rate, place.devices, place.mesh
        self.cfg = cfg = cfg.with_eval_point(self.cohort == n)
        test_counts = [len(y) for _, y in ds.test]
        self.eval_batch_size = eval_bs = eval_batch_size(cfg, test_counts)
        eval_tails = eval_tail_sizes(cfg, test_counts, eval_bs)
        # (config.json keeps the choices: a resumed run evaluates as this one, wherever it resumes)
        cfg = cfg.replace(eval_batch_size=cfg.eval_batch_size or eval_bs,
                          eval_tail_batches="on" if eval_tails else "off")
        self.train_data, self.test_data = RaggedClients.from_clients(ds.train), RaggedClients.from_clients(ds.test)
        preprocess = normalizer(*ds.normalize)
        self.options = cfg.algorithm_options()  # typed, presets applied (``RunConfig.resolved`` saves them)
        cfg, sample_accountant = sample_dp_noise(cfg, self.options, [len(y) for _, y in ds.train], self.rate)
        tails = tail_batch_sizes(cfg, [len(y) for _, y in ds.train])
        cfg = cfg.replace(tail_batches="on" if tails else "off")  # (config.json keeps the choice for --resume)
        self.trainer = build_trainer(cfg, LocalTrainer(
            ClientOptimizer(**cfg.client_training()), cfg.batch_size, cfg.local_epochs, preprocess,
            augment=make_augment(cfg.augment), tail_sizes=tails, tail_log=[]))
        self.context = RunContext(num_clients=n, num_rounds=cfg.rounds, dataset=cfg.dataset, cohort_size=self.cohort)
        self.algorithm = build_algorithm(self.options, self.model, self.trainer, self.context)
        sample_x = ds.train[0][0][:1]
        cfg, self.algorithm, self.privacy = with_dp(cfg, self.algorithm, self.options, sample_x, n, self.cohort,
                                                    self.rate, sample_accountant)
        self.cfg = cfg
        # the server's wrappers (robust rule, compression, attack, server optimizer) and the data attack
        self.malicious = malicious_of(cfg, n)
        self.algorithm = server_side(self.algorithm, cfg, self.malicious)
        poison_data(cfg, self.train_data, self.malicious, ds.num_classes)
        self.clients = clients = cfg.client_map(self.mesh)  # (the client axis split over the placement's mesh)
        self.strategy = clients.name
        if cfg.eval_point == "local":  # the models right after local training, before aggregation
            if self.algorithm.predict_trained is None:
                raise ConfigError(f"--eval-point local: {cfg.algorithm} has no prediction of a just-trained model")
            if self.cohort != n:
                raise ConfigError("--eval-point local evaluates every client right after its local training, so "
                                  "every client must train every round (drop --clients-per-round/--participation)")
        check_cohort_memory(cfg, self.algorithm, sample_x, self.cohort, n, clients.devices)
        self.backend_name, self.backend = backend_for(cfg, self.algorithm, self.train_data, place, clients,
                                                      self.model, sample_x, preprocess, self.trainer)
        self.root = jax.random.key(cfg.seed)
        evaluator = lambda alg, test, **kw: Evaluator(  # noqa: E731  (every evaluation of the run: these settings)
            alg, test, eval_batch_size=eval_bs, preprocess=preprocess, clients=clients, tail_sizes=eval_tails, **kw)
        self.evaluator = evaluator(self.algorithm, self.test_data, train=self.train_data)
        backdoor = backdoor_test_data(cfg, self.test_data)  # (--attack backdoor: the triggered test sets)
        self.backdoor_evaluator = None if backdoor is None else evaluator(self.algorithm, backdoor,
                                                                          train=self.train_data)
        # the evaluation protocol's other models and clients (``jaxfl.run.evaluation``), where it asks for them
        self.server_model = False
        if cfg.eval_model != "personal" or cfg.new_clients:
            server_shapes = jax.eval_shape(self.algorithm.init, jax.random.key(0), sample_x)[0]
            self.server_model = holds_model(server_shapes, self.model, preprocess(sample_x))
        if cfg.eval_model != "personal" and not self.server_model:
            raise ConfigError(f"--eval-model {cfg.eval_model}: {cfg.algorithm}'s server holds no whole "
                              f"{model_name(cfg)} (params and BatchNorm statistics of the model), so it has no "
                              f"global model to evaluate; use --eval-model personal")
        global_alg = self.algorithm._replace(predict=server_predict(self.model), predict_trained=None,
                                             prepare_predict=None)
        self.global_evaluator = evaluator(global_alg, self.test_data) if cfg.eval_model != "personal" else None
        self.new_evaluator, self.new_global_evaluator, self._tune = None, None, None
        if self.new_dataset is not None:  # ids n.. (after the training population's)
            new_test = RaggedClients.from_clients(self.new_dataset.test)
            if self.server_model:
                self.new_global_evaluator = evaluator(global_alg, new_test, first_id=n)
            # one local update of the method itself (no server-side or DP-FedAvg wrapper: nothing is sent), its
            # local epochs or a budget of --new-client-steps steps, from where a client starts
            trainer = self.trainer if cfg.new_client_steps is None else dataclasses.replace(
                self.trainer, epochs=cfg.new_client_steps, max_steps=cfg.new_client_steps)
            self.tuner = tuner = build_algorithm(self.options, self.model, trainer, self.context)
            self._tune_start = InitialStates(tuner.init(jax.random.fold_in(self.root, 2), sample_x)[1])
            if tuner.predict_trained is not None:
                self.new_evaluator = evaluator(tuner, new_test, first_id=n,
                                               train=RaggedClients.from_clients(self.new_dataset.train))
                local = cohort_train(tuner, clients=clients, num_rounds=cfg.rounds)
                self._tune = jax.jit(lambda server, clients, data, ids, r, root:
                                     local(server, clients, data, ids, r, root)[0])
            if self.new_global_evaluator is None and self.new_evaluator is None:
                raise ConfigError(f"--new-clients {cfg.new_clients}: {cfg.algorithm}'s server holds no whole "
                                  f"{model_name(cfg)} and its clients have no prediction right after local "
                                  f"training, so a client held out of training has nothing to be evaluated with")
        self._initial = None

    def round_fn(self, server, store, round_idx, before_aggregate=None):
        """One training round (the backend's ``round``): (server, per-client and per-round metrics)."""
        return self.backend.round(server, store, round_idx, self.root, before_aggregate=before_aggregate)

    def run_rounds(self, server, store, first: int, count: int):
        """Rounds ``first`` .. ``first + count - 1`` (the backend's ``run_rounds``): (server, [metrics])."""
        return self.backend.run_rounds(server, store, first, count, self.root)

    def init(self):
        """(server, store): the initial server state and the per-client store."""
        # the init needs only an input's shape: the first client's first image (every process has it)
        return self.backend.init(jax.random.fold_in(self.root, 2), self.dataset.train[0][0][:1])

    def initial_states(self) -> InitialStates:
        """Every client's state as a client that never trained holds it (where a new client starts from)."""
        if self._initial is None:
            self._initial = InitialStates(self.algorithm.init(jax.random.fold_in(self.root, 2),
                                                              self.dataset.train[0][0][:1])[1])
        return self._initial

    def _record(self, evaluator, server, states, predict: str = "aggregated", round_idx: int = 0,
                **kw) -> dict:
        """``eval_record`` of ``evaluator``'s metrics of these states, on the clients ``--eval-clients`` asks
        for (of the training population) after round ``round_idx``."""
        rows = None
        if self.cfg.eval_clients == "cohort" and evaluator not in (self.new_evaluator, self.new_global_evaluator):
            rows = self.backend.draw(round_idx, self.root)
        m = evaluator.metrics(server, states, predict, rows=rows, **kw)
        return eval_record(m if rows is None else on_rows(m, rows, evaluator.test.num_clients))

    def model_record(self, server, clients, predict: str = "aggregated", round_idx: int = 0) -> dict:
        """The plain test fields (test_accuracy, mean_accuracy, ...; backdoor_accuracy under a backdoor attack)
        of the models ``--eval-model`` puts there: each client's own (``clients``: a ClientStore or the
        persistent states stacked [N]; ``predict="trained"``: the rows every client's local update just
        returned), or the server's model (``--eval-model global``: ``clients`` unused)."""
        if self.cfg.eval_model == "global":
            out = self._record(self.global_evaluator, server, self.initial_states(), round_idx=round_idx)
        else:
            out = self._record(self.evaluator, server, clients, predict, round_idx)
        if self.backdoor_evaluator is not None:  # the attack's success rate (the personal models), mean over clients
            out["backdoor_accuracy"] = self._record(self.backdoor_evaluator, server, clients, predict,
                                                    round_idx)["mean_accuracy"]
        return out

    def evaluate(self, server, clients, predict: str = "aggregated", round_idx: int = 0,
                 plain: dict | None = None) -> dict:
        """metrics.jsonl's test fields after round ``round_idx`` (0-based), as the evaluation protocol asks
        (``jaxfl.run.evaluation``): ``model_record``'s (or ``plain``, those already computed: right after local
        training), the global model's under ``--eval-model both`` and the held-out clients' (``--new-clients``)."""
        out = dict(plain) if plain is not None else self.model_record(server, clients, predict, round_idx)
        if self.cfg.eval_model == "both":
            out.update(prefixed(self._record(self.global_evaluator, server, self.initial_states(),
                                             round_idx=round_idx), "global_"))
        if self.new_global_evaluator is not None:
            out.update(prefixed(self._record(self.new_global_evaluator, server, self.initial_states()), "new_"))
        if self._tune is not None:  # (the held-out clients after one local update from the global model)
            root = jax.random.fold_in(jax.random.key(self.cfg.seed), TUNE_STREAM)
            tune = lambda s, c, d, ids: self._tune(s, c, d, ids, round_idx, root)  # noqa: E731
            out.update(prefixed(self._record(self.new_evaluator, server, self._tune_start, "trained", tune=tune),
                                "new_tuned_"))
        return out

    def reliability(self, server, clients, key, **kw) -> dict:
        """``reliability.reliability_report`` of these states on this run's test sets (kw: noise_sigma, ...)."""
        from .reliability import reliability_report
        return reliability_report(self.evaluator, server, clients, key, **kw)

    def run(self, progress: bool = False, log=None, notify=None) -> RunResult:
        """Train to ``cfg.rounds`` (resuming if asked): ``train(self, ...)``."""
        return train(self, progress=progress, log=log, notify=notify)


def eval_record(m) -> dict:
    """metrics.jsonl's test fields from per-client evaluation arrays (accuracy, loss, count, diagnostics). A
    client without test samples (NaN metrics: the library's own datasets have none) is null in the lists and
    left out of the means; the means are null when no client has any."""
    acc, cnt = np.asarray(m["accuracy"], float), np.asarray(m["count"], float)
    has = cnt > 0
    listed = lambda v: [float(a) if h else None for a, h in zip(np.asarray(v, float), has)]  # noqa: E731
    extra = {f"test_{k}": listed(v) for k, v in m.items() if k not in ("accuracy", "loss", "count")}
    return {"test_accuracy": listed(acc), "test_loss": listed(m["loss"]),
            "mean_accuracy": float(acc[has].mean()) if has.any() else None,
            "weighted_accuracy": float((acc[has] * cnt[has]).sum() / cnt.sum()) if has.any() else None, **extra}


# -- the host loop: rounds, checks, logging, checkpoints -----------------------------------------------------
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]
_compiled_programs = [0]


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling jitted functions (jax.monitoring)."""
    if not getattr(compile_seconds, "listening", False):
        def listen(event, duration, **_):
            if event in COMPILE_EVENTS:
                _compile_seconds[0] += duration
            if event == COMPILE_EVENTS[-1]:  # one XLA compilation (a persistent-cache hit is none)
                _compiled_programs[0] += 1
        jax.monitoring.register_event_duration_secs_listener(listen)
        compile_seconds.listening = True
    return _compile_seconds[0]


def compiled_programs() -> int:
    """XLA programs this process has compiled (its backend compilations, small ones included: a cohort draw,
    a tree copy) since ``compile_seconds`` first listened."""
    compile_seconds()
    return _compiled_programs[0]


def open_run(exp: Experiment, notify=None):
    """(server, store, start_round, history, checkpointer or None): a fresh start, or the newest intact
    checkpoint of ``--out`` under ``--resume`` (``notify`` hears of damaged ones); writes config.json and the
    kept metrics (primary process)."""
    cfg, server, store = exp.cfg, *exp.init()
    out = Path(cfg.out) if cfg.out else None
    if out is None:
        return server, store, 0, [], None
    if cfg.overwrite:
        clear_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    start, history = 0, []
    ckpt = checkpointer(out) if cfg.resume or cfg.checkpoint_every else None
    if cfg.resume:
        server, clients, start, history = ckpt.restore_latest(server, store.state, cfg.resolved(),
                                                              out / "metrics.jsonl", notify)
        store.set(clients)
    if is_primary():
        with written(out / "config.json", "before round 1" if not start else f"at round {start}", ckpt):
            replace_text(out / "config.json", json.dumps(cfg.resolved().to_dict(), indent=2))
        with written(out / "metrics.jsonl", "before round 1" if not start else f"at round {start}", ckpt):
            replace_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
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
    """The metrics.jsonl record of a round's training: per trained client (arrays [k]), and the per-round
    metrics (scalars: the backend's ``ROUND_METRICS`` and what the algorithm reports, e.g. ``dp_clip``)."""
    ids = np.asarray(metrics["client_id"])
    per_round = {k for k, v in metrics.items() if np.ndim(v) == 0}
    return {"round": round_idx + 1, "clients_trained": [names[i] for i in ids],
            "train_loss": np.asarray(metrics["loss"], float).tolist(),
            "train_accuracy": np.asarray(metrics["accuracy"], float).tolist(),
            # the real (unpadded) samples each client trained on this round, over all its local epochs: with
            # time_s - compile_s, the run's rate of useful work
            "train_samples": np.asarray(metrics["seen"], float).tolist(),
            # algorithm-specific per-client metrics (e.g. FedSelect's personal_fraction)
            **{f"train_{k}": np.asarray(v, float).tolist() for k, v in metrics.items()
               if k not in ("loss", "accuracy", "seen", "finite", "client_id") and k not in per_round},
            **{k: metrics[k] for k in ROUND_METRICS},
            **{k: float(metrics[k]) for k in sorted(per_round - set(ROUND_METRICS))}}


def train(exp: Experiment, progress: bool = False, log=None, notify=None) -> RunResult:
    """The host loop of a built experiment: each round trains, checks for NaN, evaluates every
    ``eval_every`` rounds and at the end, appends to metrics.jsonl, checkpoints every ``checkpoint_every``
    rounds; at the end writes summary.json and accuracy.png (``--out``, primary process).

    Faults: ``--out`` is locked for the whole run (one writer); a failed write raises RunIOError (the last
    checkpoint and the log stay resumable); SIGTERM/SIGINT end the run after the current call's rounds,
    checkpointed, with ``Stopped``. ``notify`` gets one-line notices (e.g. a damaged checkpoint skipped)."""
    cfg = exp.cfg
    lock = RunLock(cfg.out) if cfg.out and is_primary() else None
    try:
        with stop_signals() as stop:
            return _train(exp, stop, progress, log, notify)
    finally:
        if lock is not None:
            lock.release()


def _train(exp: Experiment, stop: list, progress: bool, log, notify) -> RunResult:
    cfg, names = exp.cfg, exp.dataset.client_names
    server, store, start, history, ckpt = open_run(exp, notify)
    out = Path(cfg.out) if cfg.out else None
    write = out is not None and is_primary()  # every process checkpoints its rows; one logs
    bar = _progress(None, progress, start, cfg.rounds)
    r = start
    failpoint("start")
    if stop and r < cfg.rounds:  # the signal came while loading or restoring: stop before training
        if bar is not None:
            bar.close()
        where = f"stopped before round {r + 1}"
        raise Stopped(where + continue_note(cfg), stop[0], r, where)
    while r < cfg.rounds:
        failpoint("round")
        t0, c0, p0 = time.perf_counter(), compile_seconds(), compiled_programs()
        n = rounds_until_boundary(cfg, r)
        local = {}
        if cfg.eval_point == "local" and cfg.eval_model != "global" and evaluates(cfg, r):
            # the personal models right after local training (the global model and new clients after the round)
            hook = lambda s, trained, ids: local.update(exp.model_record(s, trained, "trained", r))  # noqa: E731
            server, m = exp.round_fn(server, store, r, before_aggregate=hook)
            ms = [m]
        else:
            server, ms = exp.run_rounds(server, store, r, n)
        compiling, programs = compile_seconds() - c0, compiled_programs() - p0
        per_round = (time.perf_counter() - t0 - compiling) / n  # a call's rounds share its time
        for j, m in enumerate(ms):
            check_finite(m, names, r + j, ckpt)
            rec = round_record(m, names, r + j)
            if exp.privacy is not None and cfg.dp_noise > 0:
                spent = exp.privacy.epsilon(r + j + 1)
                rec["dp_epsilon"] = spent if math.isfinite(spent) else None  # (JSON has no inf)
            t_eval, c_eval, p_eval = time.perf_counter(), compile_seconds(), compiled_programs()
            if j == n - 1 and evaluates(cfg, r + j):
                failpoint("evaluate")
                rec.update(exp.evaluate(server, store, round_idx=r + j, plain=local or None))
            # compile_s: tracing and compiling new shapes, part of time_s (the call's, on its first round);
            # compiled_programs: the XLA programs compiled for it
            rec["compile_s"] = (compiling if j == 0 else 0.0) + compile_seconds() - c_eval
            rec["compiled_programs"] = (programs if j == 0 else 0) + compiled_programs() - p_eval
            rec["time_s"] = per_round + (compiling if j == 0 else 0.0) + time.perf_counter() - t_eval
            history.append(rec)
            if write:
                with written(out / "metrics.jsonl", f"in round {r + j + 1}", ckpt):
                    with open(out / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(rec['train_loss']) if rec['train_loss'] else float('nan'):.3f}",
                                acc=f"{rec.get('mean_accuracy', float('nan')):.3f}")
            if log:
                log(rec)
        r += n
        saving = ckpt and cfg.checkpoint_every and (r % cfg.checkpoint_every == 0 or r == cfg.rounds)
        if stop and r < cfg.rounds and out is not None and not saving:  # stopping: keep this round
            ckpt = ckpt or checkpointer(out)
            saving = True
        if saving:
            failpoint("checkpoint")
            with written(ckpt.directory, f"in round {r}", ckpt):
                ckpt.save(r, server, store.state)
        if stop and r < cfg.rounds:
            if bar is not None:
                bar.close()
            raise Stopped(f"stopped at round {r}{continue_note(cfg)}", stop[0], r, f"stopped at round {r}")
    if bar is not None:
        bar.close()
    sample_x = exp.trainer.preprocess(exp.dataset.train[0][0][:1])
    result = RunResult(cfg, names, history, server, store.state, model_size(server, exp.model, sample_x),
                       [] if exp.new_dataset is None else exp.new_dataset.client_names)
    if write:
        failpoint("summary")
        with written(out / "summary.json", f"after round {r}", ckpt):
            summary = result.summary()
            if exp.malicious is not None:  # who attacked, and how
                summary["attack"] = {"attack": cfg.attack, "malicious_clients": [
                    names[i] for i in np.flatnonzero(exp.malicious)]}
            if exp.privacy is not None:  # what the run spent: (epsilon, delta) after its last round
                summary["privacy"] = dict(exp.privacy.report(r), **privacy_settings(cfg, exp.cohort, server))
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if history and not plotting_available():
            if notify is not None:
                notify(f"matplotlib is not installed: {out / 'accuracy.png'} not drawn (metrics.jsonl "
                       f"holds its values; pip install matplotlib)")
        elif history:
            failpoint("plot")
            with written(out / "accuracy.png", f"after round {r}", ckpt):
                plot_accuracy(history, names, out / "accuracy.png", title=f"{cfg.algorithm} on {cfg.dataset}, "
                              f"{model_name(cfg)}, lr {cfg.lr}, seed {cfg.seed}")
    return result


def continue_note(cfg: RunConfig) -> str:
    """How a stopped run goes on: "; continue with jaxfl run --out OUT --resume", or that nothing was saved."""
    return (f"; continue with jaxfl run --out {cfg.out} --resume" if cfg.out
            else " (no --out: nothing was saved)")


def privacy_settings(cfg: RunConfig, cohort: int, server) -> dict:
    """summary.json's record of how a DP run clipped and noised: the clip (adaptive: where it started and ended,
    the count's noise std) and the update's noise multiplier."""
    if cfg.dp_level == "sample":
        return {"per_sample_clip": cfg.dp_clip, "gradient_noise_multiplier": cfg.dp_noise}
    if cfg.dp_quantile is None:
        return {"clip": cfg.dp_clip, "update_noise_multiplier": cfg.dp_noise}
    std = dp_count_noise(cfg, cohort)
    return {"clip_initial": cfg.dp_clip, "clip_final": float(server[CLIP_KEY]), "quantile": cfg.dp_quantile,
            "count_noise_std": std, "update_noise_multiplier": value_noise_multiplier(cfg.dp_noise, std)}


def checkpointer(out: Path):
    from .checkpoint import Checkpointer
    return Checkpointer(out / "checkpoints")


@contextlib.contextmanager
def written(path: Path, when: str, ckpt):
    """Turns a failed write (disk full, file-size limit, I/O error) into one RunIOError line naming the path,
    the OS error and how to continue. Checkpoint writes (``path`` is the checkpoint folder) fail through
    orbax/TensorStore with their own exception types, so any exception there counts."""
    checkpointing = ckpt is not None and Path(path) == ckpt.directory
    try:
        yield
    except (JaxflError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001
        if not (isinstance(e, OSError) or checkpointing):
            raise
        from .checkpoint import stderr_collected  # orbax is imported only by runs that checkpoint
        with stderr_collected(pass_on_success=False):  # orbax may still log about the failed write
            last = ckpt.latest_round() if ckpt is not None else None
        why = os_error_text(e)
        out = path_out(path)
        if last is not None:
            keep = (f"the log and the checkpoint of round {last} are intact; free space or fix the error, then "
                    f"continue with jaxfl run --out {out} --resume")
        elif (Path(out) / "config.json").is_file():  # a started run: --resume starts it again from round 0
            keep = (f"no checkpoint was written yet; free space or fix the error, then continue with jaxfl run "
                    f"--out {out} --resume (it starts again from round 0 with the saved config)")
        else:
            keep = "nothing of the run was kept; free space or fix the error, then run the command again"
        raise RunIOError(f"cannot write {str(path)!r} {when}: {why}; {keep}") from None


def os_error_text(e: Exception) -> str:
    """``[Errno N] message`` of an OSError, or of the OS error code TensorStore puts in its messages
    (``... [os_error_code='27']``); else the exception's type and first line."""
    import re
    code = e.errno if isinstance(e, OSError) and e.errno else None
    found = re.search(r"os_error_code='(\d+)'", str(e))
    code = code or (int(found.group(1)) if found else None)
    if code:
        return f"[Errno {code}] {os.strerror(code)}"
    return first_line(e)


def path_out(path: Path) -> str:
    """The run folder a written path belongs to (its parent; the checkpoint folder's parent)."""
    return str(Path(path).parent)


def evaluates(cfg: RunConfig, r: int) -> bool:
    """Whether the run evaluates after round r (0-based): every ``eval_every`` rounds and after the last."""
    return (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds


def rounds_until_boundary(cfg: RunConfig, r: int) -> int:
    """How many rounds from round r (0-based) one call may run: at most ``rounds_per_call``, ending at the
    next round that evaluates or checkpoints (the host acts only between calls); 1 when evaluating after
    local training (the host evaluates inside the round)."""
    if cfg.eval_point == "local":
        return 1
    n = 1
    while n < cfg.rounds_per_call and r + n < cfg.rounds and not evaluates(cfg, r + n - 1):
        if cfg.checkpoint_every and (r + n) % cfg.checkpoint_every == 0:
            break
        n += 1
    return n


def run(cfg: RunConfig, progress: bool = False) -> RunResult:
    """Build and run an experiment."""
    return Experiment(cfg).run(progress=progress)


def _progress(it, enabled, start, total):
    """A tqdm bar over the rounds (updated by hand), or None."""
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(initial=start, total=total, desc="round", unit="round")
