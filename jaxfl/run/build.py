"""A run's build, step by step: each a small function of the config and what the steps before it made.
``runner.Experiment`` calls them in this order:

    start_devices, validate, check_output, check_device_count   (before any data is read)
    -> load_run_data (the population, and --new-clients' held-out clients) -> the model
    -> client_placement (cohort k, sampling rate q, devices and mesh)
    -> DP-SGD's noise (sample_dp_noise: given, or calibrated from the method's declared client state)
    -> the local trainer (build_trainer: DP-SGD's with that noise) and the algorithm, built once
       (``algorithms.build_algorithm``)
    -> with_dp (DP-SGD in local training: with_sample_dp checks the built algorithm; DP-FedAvg: with_user_dp)
    -> server_side (the server's wrappers, below) and poison_data (a data attack)
    -> check_cohort_memory, backend_for (choose_backend, make_backend: where the population lives, how a
       round runs)
    -> the evaluators (``runner.Experiment``; ``jaxfl.run.evaluation``)

Server-side composition, innermost first (each wrapper's ``aggregate`` calls the one inside it):

    algorithm (with DP-FedAvg's clipping and noise, if any)
    -> robust rule over the updates (``--aggregator``; ``ops.robust_aggregation``)
    -> decoding of compressed updates (``--compression``; ``ops.compression``)
    -> the malicious clients' update attack (``--attack``; ``ops.attacks``): outermost of the three, so the
       server's decoding, robust rule and clipping all see what the attackers send
    -> the server optimizer's step from the aggregate (``--server-opt``; ``core.server_opt``)

Keys: fold_in(key(seed), 7) for the attack, fold_in(key(seed), 8) for compression (4 is DP's, 0-3 and 5 the
engine's: ``core.cohort``).
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from ..core.backends import Ragged, Stacked, Streamed, device_memory_bytes
from ..core.buckets import padded_work, tails_used
from ..core.cohort import ClientMap
from ..core.cost import backend_programs, backend_seconds, run_seconds, train_flops_per_sample
from ..core.cost import lane_overhead as cost_lane_overhead
from ..core.distributed import client_mesh, cpu_cores, use_cpu_devices
from ..core.dpsgd import SampleDP
from ..core.privacy import (Accountant, SampleAccountant, bn_stats_shared, calibrate_noise, clients_keep_state,
                            default_delta, has_batch_stats, noise_for_epsilon, with_privacy)
from ..core.server_opt import with_server_optimizer
from ..core.trainer import LocalTrainer, tail_sizes
from ..core.types import Algorithm
from ..data import load_dataset
from ..data.federated import FederatedDataset, with_normalization
from ..data.lazy import is_lazy
from ..data.ragged import RaggedClients
from ..errors import ConfigError
from ..ops.attacks import (UPDATE_ATTACKS, backdoor_samples, backdoor_test, flip_labels, malicious_clients,
                           parse_attack, with_update_attack)
from ..ops.compression import parse_compression, with_compression
from ..ops.robust_aggregation import parse_aggregator, with_robust_aggregate
from .config import (ACCELERATOR_EVAL_BATCH, CPU_EVAL_BATCH, CPU_EVAL_BATCH_BY_MODEL, RunConfig, dp_count_noise,
                     model_name)
from .evaluation import held_out, split_clients

ATTACK_STREAM, COMPRESSION_STREAM = 7, 8
DP_STREAM = 4  # fold_in(key(seed), 4): DP-FedAvg's noise


def sample_dp_noise(cfg: RunConfig, options, counts: list[int], rate: float):
    """DP-SGD's noise multiplier and accountant (``--dp-level sample``), before the algorithm is built: (cfg with
    ``dp_noise`` set, its ``SampleAccountant``), or (cfg, None) without sample-level DP. The noise is ``--dp-noise``
    or the one that spends ``--dp-epsilon`` over the run; a fixed-size cohort's draw amplifies a round only where
    the method's clients keep no state (``Options.keeps_client_state``, which ``with_sample_dp`` checks against
    the built algorithm). ``counts``: every client's training samples; ``rate``: the cohort's sampling rate."""
    if cfg.dp_clip is None or cfg.dp_level != "sample":
        return cfg, None
    delta = cfg.dp_delta or default_delta(sum(counts))
    amplified = cfg.cohort_sampling == "fixed" and not options.keeps_client_state()

    def spent(z):
        return SampleAccountant(counts, cfg.batch_size, cfg.local_epochs, z, delta, rate if amplified else 1.0)

    if cfg.dp_epsilon is not None:
        cfg = cfg.replace(dp_noise=calibrate_noise(lambda z: spent(z).epsilon(cfg.rounds), cfg.dp_epsilon,
                                                   f"after {cfg.rounds} rounds at delta {delta:g}", delta))
    return cfg, spent(cfg.dp_noise)


# --tail-batches auto: the least cut of an epoch's computed samples worth the extra branches (they about double the
# local step's compile time: +3.5 s for the FedAvg CNN on a CPU, where a 15% cut of the computed samples saved
# 3-13% of a 2 s cohort training, benchmarks/RESULTS.md). Not weighed against the run's rounds: a run's rounds
# must not depend on how many follow them (a 200-round run's first 10 rounds are a 10-round run's, bit for bit).
TAIL_GAIN = 0.10


def tails_chosen(setting: str, counts, batch_size: int) -> tuple[int, ...]:
    """The partial-last-batch sizes that ``setting`` (``--tail-batches``, ``--eval-tail-batches``) asks for on
    clients of ``counts`` samples: of ``trainer.tail_sizes(batch_size)`` those their last batches take
    (``buckets.tails_used``, B last), with ``on`` always, with ``auto`` where they cut the samples computed over
    the population by ``TAIL_GAIN`` or more; else () (every batch at B)."""
    sizes = tail_sizes(batch_size)
    if setting == "off" or len(sizes) < 2:
        return ()
    used = tails_used(counts, batch_size, sizes)
    if setting == "on" or not used:
        return used
    full, _ = padded_work([], counts, batch_size, per_client_trips=True)
    cut, _ = padded_work([], counts, batch_size, per_client_trips=True, tail_sizes=used)
    return used if cut <= (1.0 - TAIL_GAIN) * full else ()


def tail_batch_sizes(cfg: RunConfig, counts) -> tuple[int, ...] | None:
    """``--tail-batches``: the sizes the run's trainer may compute a client's partial last batch at
    (``LocalTrainer.tail_sizes``, ``tails_chosen`` over an epoch's batches of the population ``counts``): only under
    ``map`` (one client at a time, where the ``lax.switch`` runs one branch), without augmentation or DP-SGD;
    else None."""
    if (cfg.strategy_or_default() != "map" or cfg.augment != "none"
            or (cfg.dp_clip is not None and cfg.dp_level == "sample")):
        return None
    return tails_chosen(cfg.tail_batches, counts, cfg.batch_size) or None


def eval_batch_size(cfg: RunConfig, counts) -> int:
    """The run's evaluation batch size: ``--eval-batch-size`` (default on a CPU ``CPU_EVAL_BATCH_BY_MODEL``'s
    entry for the model, else ``CPU_EVAL_BATCH``; ``ACCELERATOR_EVAL_BATCH`` on an accelerator), at most the
    largest test set (``counts``)."""
    chosen = cfg.eval_batch_size
    if chosen is None:
        chosen = (CPU_EVAL_BATCH_BY_MODEL.get(cfg.model, CPU_EVAL_BATCH) if jax.default_backend() == "cpu"
                  else ACCELERATOR_EVAL_BATCH)
    return min(chosen, int(max(counts)))


def eval_tail_sizes(cfg: RunConfig, counts, eval_batch_size: int) -> tuple[int, ...]:
    """``--eval-tail-batches``: the sizes an evaluation may compute a client's partial last test batch at
    (``Evaluator``'s ``tail_sizes``, ``tails_chosen`` over the test sets ``counts``): only under ``map`` (where the
    ``lax.switch`` runs one branch); else ()."""
    if cfg.strategy_or_default() != "map":
        return ()
    return tails_chosen(cfg.eval_tail_batches, counts, eval_batch_size)


def build_trainer(cfg: RunConfig, trainer: LocalTrainer) -> LocalTrainer:
    """The trainer the algorithm is built on, once: ``trainer``, or with ``--dp-level sample`` DP-SGD's on it
    (its noise multiplier set by ``sample_dp_noise``)."""
    if cfg.dp_clip is not None and cfg.dp_level == "sample":
        assert cfg.dp_noise is not None, "sample_dp_noise sets the noise before the trainer is built"
        return dataclasses.replace(trainer, dp=SampleDP(cfg.dp_clip, cfg.dp_noise))
    return trainer


def with_sample_dp(cfg: RunConfig, alg: Algorithm, options, sample_x) -> None:
    """What DP-SGD in every client's local training (``--dp-level sample``) cannot take, checked on ``alg``, built
    on the DP trainer: a model with BatchNorm (refused: its statistics mix a batch's samples), and clients that
    keep state where the method's options said they keep none (or the reverse: the accounting of
    ``sample_dp_noise`` would be wrong; an error in the method's declaration, ``Options.keeps_client_state``)."""
    key = jax.random.key(0)
    if has_batch_stats(alg, key, sample_x):
        raise ConfigError(f"--dp-level sample: {model_name(cfg)} has BatchNorm, whose statistics mix a "
                          f"batch's samples; use a model without it (logreg, mlp_2nn, femnist_cnn, "
                          f"fedavg_cnn, pfl_cnn, vit_tiny, ...)")
    keeps = clients_keep_state(alg, key, sample_x)
    if keeps != options.keeps_client_state():
        raise AssertionError(f"{cfg.algorithm}'s options say its clients keep {'no ' * keeps}state between rounds "
                             f"(Options.keeps_client_state), its init says they keep {'no ' * (not keeps)}state")


def with_user_dp(cfg: RunConfig, alg: Algorithm, options, sample_x, num_clients: int, cohort: int, rate: float):
    """DP-FedAvg (``--dp-clip`` at user level): (cfg with its noise multiplier, ``alg`` with clipped updates and
    noise on the mean (``core.privacy.with_privacy``, before any server optimizer), its ``Accountant``).
    Refused where the algorithm averages BatchNorm statistics, which the mechanism does not protect."""
    if bn_stats_shared(alg, jax.random.key(0), sample_x):
        local = (f"--{cfg.algorithm}.local-bn" if hasattr(options, "local_bn") else "fedbn")
        raise ConfigError(f"--dp-clip: {cfg.algorithm} averages the BatchNorm statistics of "
                          f"{model_name(cfg)} without noise; use a model without BatchNorm (logreg, mlp_2nn, "
                          f"femnist_cnn, fedavg_cnn, pfl_cnn, vit_tiny, ...) or keep them per client "
                          f"({local})")
    delta = cfg.dp_delta or default_delta(num_clients)
    if cfg.dp_epsilon is not None:  # the noise multiplier that spends the asked epsilon over the run
        cfg = cfg.replace(dp_noise=noise_for_epsilon(rate, cfg.rounds, delta, cfg.dp_epsilon, cfg.cohort_sampling))
    adaptive = {} if cfg.dp_quantile is None else dict(
        quantile=cfg.dp_quantile, clip_lr=cfg.dp_clip_lr, count_std=dp_count_noise(cfg, cohort))
    poisson = cfg.cohort_sampling == "poisson"  # then the sum over the expected cohort qN
    alg = with_privacy(alg, cfg.dp_clip, cfg.dp_noise, jax.random.fold_in(jax.random.key(cfg.seed), DP_STREAM),
                       **adaptive, expected_clients=rate * num_clients if poisson else None)
    return cfg, alg, Accountant(rate, cfg.dp_noise, delta, cfg.cohort_sampling)


def with_dp(cfg: RunConfig, alg: Algorithm, options, sample_x, num_clients: int, cohort: int, rate: float,
            sample_accountant: SampleAccountant | None):
    """The run's differential privacy around ``alg``: (cfg with its noise multiplier, the algorithm, its
    accountant or None): DP-SGD in local training (``--dp-level sample``: the trainer ``alg`` was built on, its
    accountant ``sample_accountant`` from ``sample_dp_noise``, checked by ``with_sample_dp``), DP-FedAvg
    (``--dp-clip``: ``with_user_dp``), or nothing."""
    if cfg.dp_clip is None:
        return cfg, alg, None
    if cfg.dp_level == "sample":
        with_sample_dp(cfg, alg, options, sample_x)
        return cfg, alg, sample_accountant
    return with_user_dp(cfg, alg, options, sample_x, num_clients, cohort, rate)


def malicious_of(cfg: RunConfig, num_clients: int) -> np.ndarray | None:
    """bool [N]: the run's malicious clients (``ops.attacks.malicious_clients``), None without an attack."""
    attack, _ = parse_attack(cfg.attack)
    return None if attack == "none" else malicious_clients(num_clients, cfg.malicious, cfg.seed)


def server_side(alg: Algorithm, cfg: RunConfig, malicious: np.ndarray | None) -> Algorithm:
    """``alg`` inside the server-side wrappers the config asks for, in the module docstring's order."""
    seed_key = jax.random.key(cfg.seed)
    name, params = parse_aggregator(cfg.aggregator)
    if name != "mean":
        alg = with_robust_aggregate(alg, name, **params)
    codec, codec_params = parse_compression(cfg.compression)
    if codec != "none":
        alg = with_compression(alg, codec, jax.random.fold_in(seed_key, COMPRESSION_STREAM), **codec_params)
    attack, attack_params = parse_attack(cfg.attack)
    if attack in UPDATE_ATTACKS:
        alg = with_update_attack(alg, attack, malicious, jax.random.fold_in(seed_key, ATTACK_STREAM), **attack_params)
    server_tx = cfg.server_optimizer()
    if server_tx is not None:
        alg = with_server_optimizer(alg, server_tx)
    return alg


def poison_data(cfg: RunConfig, train: RaggedClients, malicious: np.ndarray | None, num_classes: int) -> None:
    """A data attack on the malicious clients' training samples, in place: ``label_flip`` (y -> C - 1 - y) or
    ``backdoor`` (a triggered share relabelled; its draw from numpy's generator of [seed, 7])."""
    attack, params = parse_attack(cfg.attack)
    if attack not in ("label_flip", "backdoor"):
        return
    if attack == "backdoor" and is_lazy(train.x):
        raise ConfigError(f"--attack backdoor rewrites the malicious clients' training images in memory, but "
                          f"--dataset {cfg.dataset} reads them from its file when used (--lazy-inputs "
                          f"{cfg.lazy_inputs}); give --lazy-inputs no")
    rng = np.random.default_rng([cfg.seed, ATTACK_STREAM])
    for i in np.flatnonzero(malicious):
        rows = slice(train.offsets[i], train.offsets[i] + train.counts[i])
        if attack == "label_flip":
            train.y[rows] = flip_labels(train.y[rows], num_classes)
        else:
            train.x[rows], train.y[rows] = backdoor_samples(train.x[rows], train.y[rows], params["target"],
                                                            params["fraction"], params["size"], rng)


def backdoor_test_data(cfg: RunConfig, test: RaggedClients) -> RaggedClients | None:
    """Every client's backdoor test set (``ops.attacks.backdoor_test``) under ``--attack backdoor``, else None."""
    attack, params = parse_attack(cfg.attack)
    if attack != "backdoor":
        return None
    return RaggedClients.from_clients([
        backdoor_test(test.x[o:o + c], test.y[o:o + c], params["target"], params["size"])
        for o, c in zip(test.offsets, test.counts)])


# -- where the clients run: devices, cohort, backend --------------------------------------------------------
def platform() -> str:
    """The platform the run's arrays live on ("cpu", "gpu", "tpu")."""
    return jax.default_backend()


def forced_cpu_devices() -> bool:
    """Whether XLA_FLAGS already fixes the CPU device count (--xla_force_host_platform_device_count)."""
    return "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")


def resolve_devices(devices: int | None, cohort: int, sampling: str, cpu_split: bool = True) -> int:
    """The devices a run splits its cohort over: ``devices`` when given (0: all); unset, on a CPU in one
    process the most local devices (one per core when jax could still make them) that divide the cohort
    (any number under Poisson sampling, whose padded cohort is a multiple of 8 rows per device) unless the
    algorithm cannot split over CPU devices (``cpu_split``, ``Options.cpu_device_split``), on an accelerator 1,
    over several processes all of them (0)."""
    if devices is not None:
        return devices
    if jax.process_count() > 1:
        return 0
    if platform() != "cpu" or not cpu_split:
        return 1
    count = jax.local_device_count()
    return next(d for d in range(count, 0, -1) if sampling == "poisson" or cohort % d == 0)


def cohort_size(cfg: RunConfig, n: int) -> int:
    """Clients per round from ``clients_per_round`` or ``participation`` (a fraction), default all."""
    if cfg.clients_per_round is not None and cfg.participation is not None:
        raise ConfigError("give clients_per_round or participation, not both")
    if cfg.clients_per_round is not None:
        if cfg.clients_per_round > n:
            raise ConfigError(f"clients_per_round={cfg.clients_per_round} exceeds the {n} clients")
        return cfg.clients_per_round
    if cfg.participation is not None:  # p N up to float error (0.14 x 50 = 7.000000000000001 is 7 clients)
        return max(1, math.ceil(round(cfg.participation * n, 9)))
    return n


def sampling_rate(cfg: RunConfig, n: int) -> float:
    """q, each client's chance to train in a round: ``participation`` as given under Poisson sampling (the
    rate the accountant assumes), else the cohort's share k / N."""
    if cfg.cohort_sampling == "poisson" and cfg.participation is not None:
        return cfg.participation
    return cohort_size(cfg, n) / n


def check_cohort_memory(cfg: RunConfig, alg, sample_x, cohort: int, num_clients: int, devices: int = 1) -> None:
    """ConfigError, before the first round, when the cohort's trained models cannot fit: a round holds one
    trained copy of the server's state per client of the cohort (aggregation reads them stacked), split over
    ``devices``; refused past half a device's memory, naming the flag that sets the cohort."""
    server = jax.eval_shape(alg.init, jax.random.key(0), sample_x)[0]
    trained = server.get("params", server) if isinstance(server, dict) else server  # (a client trains the model)
    model = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(trained))
    limit = device_memory_bytes() // 2
    if model == 0 or cohort * model / devices <= limit:
        return
    fit = max(int(limit * devices // model), 1)
    every = cohort == num_clients and cfg.clients_per_round is None and cfg.participation is None
    where = f"{limit * 2 / 1e9:.0f} GB" + (f" on each of {devices} devices" if devices > 1 else "")
    raise ConfigError(f"{cohort} clients a round{' (every client trains every round)' if every else ''} hold "
                      f"{cohort * model / 1e9:.1f} GB of trained {model / 1e6:.1f} MB models, more than half of "
                      f"the device memory ({where}); give --clients-per-round at most {fit}")


def choose_backend(cfg: RunConfig, train: RaggedClients, alg, sample_x, model=None, preprocess=lambda x: x,
                   cohort: int | None = None, devices: int | None = None) -> str:
    """``--backend``, else ``stacked`` when the population fits (its samples and every client's persistent
    state in a quarter of the device's memory, on each device of the mesh; one process, no host store asked
    for) and one call over the whole cohort wastes little (``map``: every client its own steps;
    ``vmap``/``chunked`` with a lane plan; or clients within 25% of the mean step count) or, on an
    accelerator, its modelled run time is no longer than the ragged backend's (``stacked_is_faster``: padded
    lanes against the ragged backend's extra sequential steps, host transfers and bucket programs to compile,
    over the run's rounds); else, in one process,
    ``streamed`` (the population on the host, each cohort in one call of one of a few shapes) where one call
    wastes little, and ``ragged`` (buckets of similar clients) where it would not, or over several processes.
    A ConfigError if rounds_per_call > 1 cannot be honoured or a backend is asked for where it cannot run."""
    if cfg.backend in ("stacked", "streamed") and jax.process_count() > 1:
        raise ConfigError(f"backend={cfg.backend} runs within one process; a run over {jax.process_count()} "
                          f"processes needs --backend ragged")
    if cfg.backend:
        return cfg.backend
    if jax.process_count() > 1:
        return _on_the_host(cfg, "ragged", "the run spans processes")
    steps = -(-train.counts // cfg.batch_size)
    # map: every client runs its own steps; vmap/chunked with a lane plan: sorted chunks, each to its own longest
    # client (``core.lanes``); one vmap over the cohort: every lane to the cohort's longest client
    even = cfg.strategy_or_default() == "map" or cfg.lane_segments > 0 or steps.max() <= 1.25 * steps.mean()
    if cfg.client_store == "host":
        return _on_the_host(cfg, "streamed" if even else "ragged", "the run keeps states on the host")
    states = jax.eval_shape(alg.init, jax.random.key(0), sample_x)[1]
    per_client = sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree_util.tree_leaves(states))
    state_bytes = train.num_clients * per_client
    # every device of the mesh holds the whole population; CPU devices share the host's memory
    devices = cfg.devices if devices is None else devices  # (the run's resolved count, ``resolve_devices``)
    copies = (devices or jax.device_count()) if platform() == "cpu" else 1
    fits = copies * (train.nbytes + state_bytes) <= device_memory_bytes() // 4
    if fits and even:
        return "stacked"
    if fits and model is not None and platform() != "cpu":
        if stacked_is_faster(cfg, train, model, sample_x, preprocess, cohort or train.num_clients):
            return "stacked"
    if not fits and even:
        return _on_the_host(cfg, "streamed", "the population does not fit on the device")
    return _on_the_host(cfg, "ragged", "the population does not fit on the device or its client sizes are too "
                                       "uneven for one call")


def stacked_is_faster(cfg: RunConfig, train: RaggedClients, model, sample_x, preprocess, cohort: int) -> bool:
    """On an accelerator: whether the run is modelled to take no longer with one stacked call per round (padded
    lanes, no transfers, one round program) than with the ragged backend's buckets and host transfers (a program
    per bucket class): ``core.cost.backend_seconds`` per round, ``run_seconds`` over the run's rounds with its
    programs' compile time."""
    sample_bytes = math.prod(train.x.shape[1:]) * train.x.itemsize + train.y.itemsize
    try:
        flops = train_flops_per_sample(model, sample_x, cfg.batch_size, preprocess)
    except ValueError:  # no FLOP count from XLA here: keep the ragged backend, right for any model
        return False
    clients = cfg.client_map()
    stacked, ragged = backend_seconds(train.counts, cfg.batch_size, cohort, flops, sample_bytes, clients=clients,
                                      epochs=cfg.local_epochs)
    programs = backend_programs(-(-train.counts // cfg.batch_size), cohort, clients)
    return run_seconds(stacked, cfg.rounds, programs[0]) <= run_seconds(ragged, cfg.rounds, programs[1])


def _on_the_host(cfg: RunConfig, backend: str, why: str) -> str:
    """``backend`` (streamed or ragged: the population on the host), unless rounds_per_call > 1 asks to keep
    rounds on the device (a ConfigError saying ``why`` it cannot)."""
    if cfg.rounds_per_call > 1:
        raise ConfigError(f"rounds_per_call={cfg.rounds_per_call} needs the population on the device (--backend "
                          f"stacked), but {why}; use --rounds-per-call 1")
    return backend


def make_backend(name: str, cfg: RunConfig, alg, train: RaggedClients, cohort: int, rate: float, clients: ClientMap,
                 overhead: float | None, trainer: LocalTrainer | None = None):
    """The data backend ``name`` (``choose_backend``'s choice) for the run's settings: ``Stacked`` (with K rounds
    per call and the lane plan), ``Streamed`` (the lane plan, the state store) or ``Ragged`` (the state store);
    ``clients``: the run's client map, with its mesh; ``overhead``: the lane plan's step overhead
    (``lane_overhead``)."""
    lanes = {"lane_segments": cfg.lane_segments, "lane_overhead": overhead}
    kw = {"stacked": dict(lanes, rounds_per_call=cfg.rounds_per_call),
          "streamed": dict(lanes, client_store=cfg.client_store),
          "ragged": {"client_store": cfg.client_store}}[name]
    return {"stacked": Stacked, "streamed": Streamed, "ragged": Ragged}[name](
        alg, train, batch_size=cfg.batch_size, clients=clients,
        cohort_size=cohort, weighting=cfg.weighting, num_rounds=cfg.rounds, stragglers=cfg.stragglers,
        sampling=cfg.cohort_sampling, rate=rate, trainer=trainer, **kw)


def backend_for(cfg: RunConfig, alg: Algorithm, train: RaggedClients, place: Placement, clients: ClientMap, model,
                sample_x, preprocess, trainer: LocalTrainer | None = None):
    """(name, the built backend): ``choose_backend``'s choice for the run's placement, built by ``make_backend``
    with the run's client map ``clients`` (``cfg.client_map(place.mesh)``; the lane plan's step overhead,
    ``lane_overhead``, only for the backends that plan lanes; ``trainer``: the one ``alg`` was built on, whose
    partial-batch sizes the backend's ``padded_work`` counts)."""
    name = choose_backend(cfg, train, alg, sample_x, model, preprocess, place.cohort, place.devices)
    overhead = lane_overhead(cfg, model, sample_x, preprocess) if name in ("stacked", "streamed") else None
    return name, make_backend(name, cfg, alg, train, place.cohort, place.rate, clients, overhead, trainer)


def lane_overhead(cfg: RunConfig, model, sample_x, preprocess) -> float | None:
    """The stacked backend's lane-plan step overhead: ``--lane-overhead``, else ``model_lane_overhead``."""
    if cfg.lane_overhead is not None:
        return cfg.lane_overhead
    return model_lane_overhead(model, sample_x, cfg.batch_size, preprocess)


def model_lane_overhead(model, sample_x, batch_size: int, preprocess=lambda x: x) -> float | None:
    """On an accelerator the cost model's tau P / (B f) for ``model`` at ``batch_size`` (a step's launch latency
    in lane-steps of this model, capped; ``core.cost.lane_overhead``), else None (the backend's platform
    default)."""
    if platform() == "cpu" or model is None:
        return None
    try:
        return cost_lane_overhead(train_flops_per_sample(model, sample_x, batch_size, preprocess), batch_size)
    except ValueError:  # no FLOP count from XLA here: the platform's default
        return None


def start_devices(cfg: RunConfig) -> None:
    """On a CPU, before jax starts: ``devices=N`` runs N CPU devices; unset, one per core is made available (a
    single-process run then splits its cohort over them when it divides evenly)."""
    if isinstance(cfg.devices, int):
        use_cpu_devices(cfg.devices)
    elif cfg.devices is None and not jax.distributed.is_initialized() and not forced_cpu_devices():
        use_cpu_devices(cpu_cores())


def check_device_count(cfg: RunConfig) -> None:
    """ConfigError, before any data is read, when ``devices`` asks for more devices than the run can have."""
    if cfg.devices is None or cfg.devices <= jax.device_count():
        return
    count = jax.device_count()
    if platform() == "cpu" and cfg.devices > cpu_cores():
        raise ConfigError(f"devices={cfg.devices}: a CPU run makes at most one device per core and this "
                          f"machine has {cpu_cores()} cores; use --devices 0 (all) or at most {cpu_cores()}")
    if platform() == "cpu":  # a library caller whose jax had started with fewer devices
        raise ConfigError(f"devices={cfg.devices}: jax started before this run with {count} CPU device(s) "
                          f"and cannot make more; call jaxfl.core.distributed.use_cpu_devices("
                          f"{cfg.devices}) before any jax work, or use devices at most {count}")
    raise ConfigError(f"devices={cfg.devices}: this machine has {count} {jax.default_backend()} "
                      f"device(s); use --devices 0 (all) or at most {count}")


def load_run_data(cfg: RunConfig) -> tuple[FederatedDataset, FederatedDataset | None]:
    """(the training population's dataset, the held-out clients' or None): the run's dataset, with
    ``--new-clients K`` clients drawn from the seed held out of training (``evaluation.held_out``)."""
    ds = with_normalization(load_dataset(cfg.data_config()), cfg.normalize)
    if not cfg.new_clients:
        return ds, None
    total = len(ds.client_names)
    if cfg.new_clients >= total:
        raise ConfigError(f"--new-clients {cfg.new_clients}: --dataset {cfg.dataset} has {total} clients, and at "
                          f"least one must train; hold out at most {total - 1}")
    return split_clients(ds, held_out(cfg.seed, total, cfg.new_clients))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's clients train: ``cohort`` clients a round (k), each client's chance to train ``rate`` (q),
    split over ``devices`` devices (0: all) of ``mesh`` (None: one device)."""
    cohort: int
    rate: float
    devices: int
    mesh: jax.sharding.Mesh | None


def client_placement(cfg: RunConfig, n: int) -> Placement:
    """The run's ``Placement`` over a population of ``n`` clients; ConfigError where the cohort cannot be split
    over the devices asked for, or the algorithm cannot run on several CPU devices."""
    # devices != 1: the client axis is split over a mesh of that many devices (0: all of them); a multi-process
    # run (jaxfl.distributed.initialize) always uses every device of every process
    if jax.process_count() > 1 and cfg.devices not in (0, None, jax.device_count()):
        raise ConfigError(f"devices={cfg.devices}: a run over {jax.process_count()} processes splits the "
                          f"clients over all {jax.device_count()} devices; use devices=0")
    cohort, rate = cohort_size(cfg, n), sampling_rate(cfg, n)
    from ..algorithms import REGISTRY
    splits = REGISTRY[cfg.algorithm].options.cpu_device_split
    devices = resolve_devices(cfg.devices, cohort, cfg.cohort_sampling, splits)
    if not splits and platform() == "cpu" and devices != 1 and jax.process_count() == 1:
        raise ConfigError(f"--algorithm {cfg.algorithm} runs on one CPU device: its batched LAPACK calls on "
                          f"several CPU devices at once deadlock in jaxlib; drop --devices {cfg.devices}")
    mesh = None if devices == 1 else client_mesh(devices or None)
    # (a Poisson cohort is padded to a multiple of 8 rows per device: any expected size splits)
    if mesh is not None and cfg.cohort_sampling == "fixed" and cohort % mesh.devices.size:
        raise ConfigError(f"{cohort} clients per round cannot be split evenly over devices={mesh.devices.size}; "
                          f"use a cohort that is a multiple of it")
    return Placement(cohort, rate, devices, mesh)
