"""Run configuration: one flat, frozen dataclass, loadable from TOML/JSON and overridable from the CLI."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from pathlib import Path

from ..core.backends import BACKENDS, PLACEMENTS
from ..core.cohort import SAMPLINGS, STRATEGIES, default_strategy
from ..core.distributed import is_primary
from ..core.options import accepts_none, check_int_size, coerce, field_type, plain
from ..core.privacy import DEFAULT_CLIP_LR, DP_LEVELS
from ..ops.attacks import ATTACKS, UPDATE_ATTACKS, parse_attack
from ..ops.compression import parse_compression
from ..ops.robust_aggregation import parse_aggregator
from ..core.server_opt import DEFAULT_SERVER_LR, SERVER_OPTIMIZERS, server_optimizer
from ..core.step import WEIGHTINGS
from ..core.trainer import OPTIMIZERS
from ..data.federated import PREFIX_ARGUMENT, TEXT_DATASETS, DataConfig
from ..errors import ConfigError, check_choice, check_range
from .lock import LOCK_NAME, check_free


# The values of the protocol fields that neither the config nor the algorithm's ``train_preset`` sets. (An
# algorithm's ``train_preset`` may also name an ``eval_point``: it applies when every client trains every round.)
TRAINING_DEFAULTS = {"batch_size": 64, "lr": 0.01, "momentum": 0.5, "weight_decay": 0.0}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on. ``None`` means "the preset's / backend's default"."""
    algorithm: str = "fedbn"
    dataset: str = "default"
    model: str | None = None
    rounds: int = 10
    local_epochs: int = 1
    # None: the algorithm's protocol (``train_preset``: what its official code trains with), else TRAINING_DEFAULTS
    batch_size: int | None = None
    lr: float | None = None
    momentum: float | None = None
    optimizer: str = "sgd"
    weight_decay: float | None = None
    nesterov: bool = False
    seed: int = 0
    # server optimizer (FedOpt) of the averaging algorithms: none (the plain mean) | sgd | adagrad | adam | yogi
    server_opt: str = "none"
    server_lr: float | None = None  # None: 1 (sgd), 0.1 (adagrad), 0.01 (adam, yogi)
    server_momentum: float = 0.0
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    # robust aggregation of the averaging algorithms (``jaxfl.ops.robust_aggregation``): mean (the algorithm's
    # own) | NAME or NAME:key=value,... of median, trimmed_mean, krum, multi_krum, bulyan, geometric_median,
    # norm_bound, centered_clip
    aggregator: str = "mean"
    # malicious clients (``jaxfl.ops.attacks``): the attack (none | sign_flip | scale | gaussian | alie | ipm |
    # label_flip | backdoor, NAME:key=value,...) and the fraction of the population that runs it (fixed per run)
    attack: str = "none"
    malicious: float = 0.0
    # update compression of the averaging algorithms (``jaxfl.ops.compression``): none | topk | randk | quantize |
    # qsgd | sign, NAME:key=value,...
    compression: str = "none"
    # user-level differential privacy of the averaging algorithms (DP-FedAvg, ``jaxfl.core.privacy``); None: off
    dp_clip: float | None = None  # C: each client's update of the shared parameters is clipped to l2 norm C
    # user: DP-FedAvg (a client's update clipped); sample: DP-SGD in local training (each sample's gradient
    # clipped to dp_clip, noise z C on a step's sum; ``jaxfl.core.dpsgd``)
    dp_level: str = "user"
    dp_noise: float = 0.0  # z: Gaussian noise of std z C / k on the mean of the cohort's k clipped updates
    dp_delta: float | None = None  # δ of the reported ε (None: N^-1.1 for N clients)
    dp_epsilon: float | None = None  # calibrate z: the smallest noise multiplier that spends at most this ε
    dp_quantile: float | None = None  # adaptive clipping: C (from dp_clip) tracks this quantile of the update norms
    dp_clip_lr: float = DEFAULT_CLIP_LR  # adaptive clipping: the geometric update's learning rate
    dp_count_noise: float | None = None  # adaptive clipping: the clipped count's noise std (None: 0.05 k with noise)
    # algorithm options by algorithm, e.g. {"fedselect": {"alpha": 0.5}}: each algorithm's Options dataclass
    # (``jaxfl.algorithms``) owns its defaults, presets and checks; the CLI's --fedselect.alpha, a [fedselect]
    # table in TOML. The run uses only the table of ``algorithm``.
    options: dict = dataclasses.field(default_factory=dict)
    # data
    data_dir: str | None = None
    num_clients: int | None = None
    clients_per_domain: int = 1
    partition: str | None = None
    dirichlet_alpha: float = 0.5
    client_sizes: str = "equal"
    size_sigma: float = 0.5
    classes_per_client: int = 2
    samples_per_client: int | None = None
    test_per_client: int | None = None
    image_size: int | None = None
    channels: int = 3
    # engine
    clients_per_round: int | None = None
    participation: float | None = None
    # fixed: exactly k clients a round (without replacement) | poisson: each client with probability k / N
    cohort_sampling: str = "fixed"
    stragglers: float = 0.0  # systems heterogeneity: the chance a client runs only part of its local work
    weighting: str = "samples"
    strategy: str | None = None
    backend: str | None = None  # stacked (population on the device) | streamed (cohort sent per round) | ragged
    rounds_per_call: int = 1  # stacked: rounds run in one jitted call (the host acts between calls)
    chunk_size: int = 8
    # stacked backend, vmap/chunked: the cohort sorted by local steps, in at most this many segments of chunks of
    # lanes (``core.lanes``; 0: one vmap over the cohort); a local step's fixed cost in lanes (None: the platform's)
    lane_segments: int = 3
    lane_overhead: float | None = None
    devices: int | None = None
    client_store: str = "auto"
    eval_every: int = 1
    eval_point: str | None = None  # aggregated: after the round | local: each model right after local training
    eval_batch_size: int = 256
    # evaluation protocols (``jaxfl.run.evaluation``): which model (personal | global | both), which clients
    # (all | cohort: the evaluated round's), and K clients held out of training, evaluated as newcomers
    eval_model: str = "personal"
    eval_clients: str = "all"
    new_clients: int = 0
    new_client_steps: int | None = None  # the held-out clients' update: at most this many local steps
    # output
    out: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False

    def data_config(self) -> DataConfig:
        names = {f.name for f in dataclasses.fields(DataConfig)}
        return DataConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        """Plain JSON types (tuples as lists, so a saved config compares equal after loading); the algorithm
        tables at the top level under their algorithm's name, as in a config file."""
        d = {k: plain(v) for k, v in dataclasses.asdict(self).items() if k != "options"}
        return dict(d, **{name: {k: plain(v) for k, v in table.items()} for name, table in self.options.items()})

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """A RunConfig from a config file's dict: RunConfig fields, and tables named by algorithm (unknown
        keys are an error)."""
        from ..algorithms import REGISTRY
        fields = {f.name for f in dataclasses.fields(cls)} - {"options"}
        bad = sorted(k for k in values if k not in fields and k not in REGISTRY)
        if bad:
            raise ConfigError(f"unknown config keys {bad}; valid: {', '.join(sorted(fields))}, or a table "
                              f"named by an algorithm ({', '.join(REGISTRY)})")
        tables = {k: v for k, v in values.items() if k in REGISTRY}
        for name, table in tables.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{name} must be a table of {name}'s options, got {table!r}")
        for f in dataclasses.fields(cls):  # a JSON null where a value is needed
            if f.name in values and values[f.name] is None and not accepts_none(cls, f):
                raise ConfigError(f"{f.name}=null needs a value (default: {f.default!r})")
        typed = {f.name: coerce(f.name, field_type(cls, f), values[f.name]) for f in dataclasses.fields(cls)
                 if f.name in values}
        return cls(**typed, options=tables)

    def algorithm_options(self):
        """The typed, checked options of ``algorithm`` (its table, fields left None from the dataset's preset)."""
        from ..algorithms import algorithm_options
        return algorithm_options(self.algorithm, self.options.get(self.algorithm), self.dataset)

    def with_protocol(self) -> "RunConfig":
        """This config with every protocol field left None (``TRAINING_DEFAULTS``' keys) taken from the
        algorithm's ``train_preset``, else from ``TRAINING_DEFAULTS``."""
        from ..algorithms import REGISTRY, options_class
        preset = options_class(self.algorithm).train_preset if self.algorithm in REGISTRY else {}
        return self.replace(**{k: preset.get(k, default) for k, default in TRAINING_DEFAULTS.items()
                               if getattr(self, k) is None})

    def with_eval_point(self, every_client_every_round: bool) -> "RunConfig":
        """This config with ``eval_point`` set: its own, else the algorithm's ``train_preset`` value when every
        client trains every round (evaluating a model right after local training needs it), else aggregated."""
        if self.eval_point is not None:
            return self
        from ..algorithms import options_class
        preset = options_class(self.algorithm).train_preset.get("eval_point", "aggregated")
        return self.replace(eval_point=preset if every_client_every_round else "aggregated")

    def client_training(self) -> dict:
        """The client optimizer's settings (protocol fields left None resolved by ``with_protocol``)."""
        cfg = self.with_protocol()
        return {"name": cfg.optimizer, "lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                "nesterov": cfg.nesterov}

    def strategy_or_default(self) -> str:
        """The client strategy: ``strategy``, else ``map`` on CPU and ``vmap`` on accelerators."""
        return self.strategy or default_strategy()

    def resolved(self) -> "RunConfig":
        """This config with the run's algorithm table written out in full (every option, presets applied) and
        the client optimizer's weight decay filled in: what a run saves, so that its config.json says every
        value it used."""
        cfg = self.with_protocol().replace(options={self.algorithm: self.algorithm_options().to_dict()})
        if cfg.server_opt != "none" and cfg.server_lr is None:
            cfg = cfg.replace(server_lr=DEFAULT_SERVER_LR[cfg.server_opt])
        return cfg

    def server_optimizer(self):
        """The optax transformation of ``server_opt`` (None for "none")."""
        if self.server_opt == "none":
            return None
        return server_optimizer(self.server_opt, self.server_lr, self.server_momentum, self.server_beta1,
                                self.server_beta2, self.server_tau)


DEFAULT_MODEL = {"default": "digits_cnn", "digits": "digits_cnn", "pacs": "digits_cnn"}


def model_name(cfg: RunConfig) -> str:
    """--model, else the first model the algorithm allows, else the dataset's default (small_cnn otherwise;
    char_lstm for text)."""
    from ..algorithms import options_class
    allowed = options_class(cfg.algorithm).models
    default = "char_lstm" if is_text(cfg.dataset) else DEFAULT_MODEL.get(cfg.dataset, "small_cnn")
    return cfg.model or (allowed[0] if allowed else default)


def is_text(dataset: str) -> bool:
    """Whether ``dataset`` holds token ids (``TEXT_DATASETS``) rather than images."""
    return any(dataset.startswith(t) for t in TEXT_DATASETS)


def check_modality(cfg: RunConfig) -> None:
    """ConfigError unless the run's model reads what its dataset holds: token ids (``models.TEXT_MODELS``) or
    images (every other model)."""
    from ..algorithms import options_class
    from ..models import TEXT_MODELS
    model, text = model_name(cfg), is_text(cfg.dataset)
    if text and model not in TEXT_MODELS:
        allowed = options_class(cfg.algorithm).models
        which = (f"--model {model} reads images" if cfg.model is not None or not allowed else
                 f"{cfg.algorithm} runs on images only (its models: {', '.join(allowed)})")
        raise ConfigError(f"--dataset {cfg.dataset} holds text (token ids) and {which}; text needs --model "
                          f"{' or '.join(TEXT_MODELS)}")
    if not text and model in TEXT_MODELS:
        raise ConfigError(f"--model {model} reads text (token ids) and --dataset {cfg.dataset} holds images; use "
                          f"a text dataset ({dataset_names(TEXT_DATASETS)}) "
                          f"or an image model")


# how each kind of dataset is split into clients, its datasets (a prefix ends in ":") and the options that shape it
DATASET_KINDS = {
    "label": ("is split by label", ("mnist", "cifar10", "tfds:"),
              ("num_clients", "partition", "dirichlet_alpha", "classes_per_client", "client_sizes", "size_sigma")),
    "domain": ("has one client per domain (--clients-per-domain k splits each into k)",
               ("default", "digits", "pacs", "folder:"), ("clients_per_domain",)),
    "writers": ("has --num-clients synthetic writers", ("synthetic_text",), ("num_clients", "size_sigma")),
    "files": ("has one client per file (text:) or user (leaf:, leaf_femnist:, leaf_celeba:, leaf_sent140:)",
              ("text:", "leaf:", "leaf_femnist:", "leaf_celeba:", "leaf_sent140:"), ()),
    "natural": ("has its natural clients (--num-clients N keeps the first N by id)",
                ("tff_emnist:", "tff_shakespeare:", "tff_cifar100:", "tff_stackoverflow:"), ("num_clients",)),
}


def dataset_names(names) -> str:
    """"mnist, tfds:NAME": dataset names as --help writes them (a prefix with what follows it)."""
    return ", ".join(n + PREFIX_ARGUMENT.get(n, "") for n in names)


def dataset_kind(dataset: str) -> str | None:
    """``DATASET_KINDS``' key of a dataset name (None for an unknown one: loading names the valid ones)."""
    return next((kind for kind, (_, names, _) in DATASET_KINDS.items()
                 if any(dataset == n or (n.endswith(":") and dataset.startswith(n)) for n in names)), None)


def check_data_options(cfg: RunConfig) -> None:
    """ConfigError for a data option set (away from its default) that the dataset's split does not read, e.g.
    --partition on a domain dataset (it would be ignored)."""
    kind = dataset_kind(cfg.dataset)
    if kind is None:
        return
    default = RunConfig()
    for name in sorted({f for _, _, fields in DATASET_KINDS.values() for f in fields} - set(DATASET_KINDS[kind][2])):
        if getattr(cfg, name) != getattr(default, name):
            users = [k for k, (_, _, fields) in DATASET_KINDS.items() if name in fields]
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: --dataset {cfg.dataset} "
                              f"{DATASET_KINDS[kind][0]}, so it would be ignored; it applies to "
                              f"{', '.join(dataset_names(DATASET_KINDS[k][1]) for k in users)}")


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigError naming the first bad value; otherwise return cfg with its protocol fields resolved
    (``RunConfig.with_protocol``)."""
    from ..algorithms import REGISTRY, algorithm_options, options_class
    from ..models import MODELS
    check_choice("algorithm", cfg.algorithm, REGISTRY)
    cfg = cfg.with_protocol()
    for f in dataclasses.fields(cfg):  # every rate, fraction and scale: inf/nan is never meant
        if f.name != "options":  # a RunConfig built in Python: each value of its field's type
            coerce(f.name, field_type(type(cfg), f), getattr(cfg, f.name))
        v = getattr(cfg, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{f.name}={v} must be a finite number")
        check_int_size(f.name, v)
    if cfg.model is not None:
        check_choice("model", cfg.model, MODELS)
        allowed = options_class(cfg.algorithm).models
        if allowed is not None and cfg.model not in allowed:
            raise ConfigError(f"--algorithm {cfg.algorithm} cannot use --model {cfg.model}; it needs one of: "
                              f"{', '.join(allowed)}")
    check_modality(cfg)
    if cfg.strategy is not None:
        check_choice("strategy", cfg.strategy, STRATEGIES)
    if cfg.backend is not None:
        check_choice("backend", cfg.backend, BACKENDS)
    if cfg.rounds_per_call > 1 and cfg.backend in ("ragged", "streamed"):
        raise ConfigError(f"rounds_per_call={cfg.rounds_per_call} keeps rounds on the device: it needs --backend "
                          f"stacked (or the default, which picks stacked when the population fits)")
    check_choice("weighting", cfg.weighting, WEIGHTINGS)
    check_choice("client_store", cfg.client_store, PLACEMENTS)
    check_choice("client_sizes", cfg.client_sizes, ("equal", "lognormal"))
    if cfg.size_sigma < 0:
        raise ConfigError(f"size_sigma={cfg.size_sigma} must be >= 0")
    for name in ("rounds", "local_epochs", "batch_size", "chunk_size", "eval_every", "eval_batch_size",
                 "rounds_per_call", "clients_per_domain", "num_clients", "samples_per_client", "test_per_client",
                 "image_size",
                 "clients_per_round"):  # the last five may be None (the preset's default)
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    if cfg.lane_segments < 0:
        raise ConfigError(f"lane_segments={cfg.lane_segments} must be >= 0 (0: one vmap call over the cohort)")
    if cfg.lane_overhead is not None:
        check_range("lane_overhead", cfg.lane_overhead, 0.0, float("inf"))
    check_range("dirichlet_alpha", cfg.dirichlet_alpha, 0.0, float("inf"), lo_open=True)
    check_range("lr", cfg.lr, 0.0, float("inf"), lo_open=True)
    check_range("momentum", cfg.momentum, 0.0, 1.0)
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    if cfg.eval_point is not None:
        check_choice("eval_point", cfg.eval_point, ("aggregated", "local"))
    check_evaluation(cfg)
    check_range("weight_decay", cfg.weight_decay, 0.0, float("inf"))
    if cfg.nesterov and (cfg.optimizer != "sgd" or cfg.momentum <= 0):
        raise ConfigError("--nesterov needs --optimizer sgd with --momentum > 0")
    check_choice("server_opt", cfg.server_opt, SERVER_OPTIMIZERS)
    if cfg.server_opt != "none":
        check_marked(cfg, "server_optimizer", f"--server-opt {cfg.server_opt}: {cfg.algorithm}'s aggregate is not a "
                                              f"mean of shared parameters; a server optimizer composes with")
    if cfg.server_lr is not None:
        check_range("server_lr", cfg.server_lr, 0.0, float("inf"), lo_open=True)
    check_range("server_momentum", cfg.server_momentum, 0.0, 1.0)
    check_range("server_beta1", cfg.server_beta1, 0.0, 1.0)
    check_range("server_beta2", cfg.server_beta2, 0.0, 1.0)
    check_range("server_tau", cfg.server_tau, 0.0, float("inf"), lo_open=True)
    check_server_rule(cfg, "--aggregator", cfg.aggregator, parse_aggregator, "mean", "a robust aggregator")
    check_attack(cfg)
    check_server_rule(cfg, "--compression", cfg.compression, parse_compression, "none", "update compression")
    check_privacy(cfg)
    if cfg.participation is not None:
        check_range("participation", cfg.participation, 0.0, 1.0, lo_open=True)
    check_choice("cohort_sampling", cfg.cohort_sampling, SAMPLINGS)
    if cfg.cohort_sampling == "poisson" and not options_class(cfg.algorithm).poisson_sampling:
        unable = ", ".join(n for n, r in REGISTRY.items() if not r.options.poisson_sampling)
        raise ConfigError(f"--cohort-sampling poisson pads each round's cohort with rows of weight 0, which "
                          f"{cfg.algorithm}'s aggregate does not treat as absent (algorithms without Poisson "
                          f"sampling: {unable}); use --cohort-sampling fixed")
    check_range("stragglers", cfg.stragglers, 0.0, 1.0)
    if cfg.stragglers:
        work, count = straggler_work_count(cfg)
        if count < 2:
            flag = work.replace("_", "-") if work == "local_epochs" else f"{cfg.algorithm}.{work.replace('_', '-')}"
            raise ConfigError(f"stragglers={cfg.stragglers}: a straggler runs 1 to E-1 of its E {work}, so "
                              f"--{flag} must be at least 2 (it is {count})")
    if cfg.devices is not None and cfg.devices < 0:
        raise ConfigError(f"devices={cfg.devices} must be >= 0 (0: all devices, 1: no sharding; unset: on a CPU "
                          f"one device per core when the cohort splits evenly)")
    if cfg.checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every={cfg.checkpoint_every} must be >= 0")
    if (cfg.resume or cfg.checkpoint_every) and not cfg.out:
        raise ConfigError("checkpoints and --resume need an output directory (--out DIR)")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --out, --overwrite replaces it: give one of them")
    for name, table in cfg.options.items():  # every table given, not only the run's: a typo is caught
        check_choice("algorithm table", name, REGISTRY)
        algorithm_options(name, table, cfg.dataset)
    check_data_options(cfg)  # (after the ranges: a bad value is named as such first)
    return cfg


def check_privacy(cfg: RunConfig) -> None:
    """The DP-FedAvg options (``dp_clip``, ``dp_noise``, ``dp_delta``; adaptive clipping's ``dp_quantile``,
    ``dp_clip_lr``, ``dp_count_noise``): ConfigError naming the first bad one."""
    if cfg.dp_epsilon is not None:
        if cfg.dp_clip is None:
            raise ConfigError("--dp-epsilon needs --dp-clip C (the clipping norm the calibrated noise is scaled to)")
        if cfg.dp_noise:
            raise ConfigError(f"--dp-epsilon {cfg.dp_epsilon:g} sets the noise multiplier: give it or --dp-noise "
                              f"{cfg.dp_noise:g}, not both")
        check_range("dp_epsilon", cfg.dp_epsilon, 0.0, float("inf"), lo_open=True)
    tuning = cfg.dp_clip_lr != DEFAULT_CLIP_LR or cfg.dp_count_noise is not None  # adaptive clipping's knobs
    check_choice("dp_level", cfg.dp_level, DP_LEVELS)
    if cfg.dp_clip is None:
        if (cfg.dp_noise or cfg.dp_delta is not None or cfg.dp_quantile is not None or tuning
                or cfg.dp_level != "user"):
            raise ConfigError("--dp-noise, --dp-delta, --dp-level and the adaptive clipping options need --dp-clip C "
                              "(the clipping norm the noise is scaled to; with --dp-quantile, its starting value)")
        return
    if cfg.dp_level == "sample":
        check_sample_privacy(cfg, tuning)
        return
    if cfg.dp_quantile is None and tuning:
        raise ConfigError("--dp-clip-lr and --dp-count-noise adapt the clipping norm: they need --dp-quantile Q")
    if cfg.dp_quantile is not None:
        if not 0 < cfg.dp_quantile < 1:
            raise ConfigError(f"dp_quantile={cfg.dp_quantile!r} is outside (0, 1)")
        check_range("dp_clip_lr", cfg.dp_clip_lr, 0.0, float("inf"))
        if cfg.dp_count_noise is not None:
            check_range("dp_count_noise", cfg.dp_count_noise, 0.0, float("inf"))
    check_dp_ranges(cfg)
    check_marked(cfg, "user_dp", f"--dp-clip: {cfg.algorithm}'s aggregate is not an equal-weight mean of shared "
                                 f"parameters alone; DP-FedAvg composes with")
    if cfg.weighting != "uniform":
        raise ConfigError(f"--dp-clip: DP-FedAvg averages the cohort with equal weights (--weighting {cfg.weighting} "
                          f"would let one client move the mean by more than 2C/k); add --weighting uniform")


def check_sample_privacy(cfg: RunConfig, tuning: bool) -> None:
    """DP-SGD's options (``dp_level`` sample): the clip, noise and delta ranges, no adaptive clipping, an
    algorithm whose local work is DP-SGD's (``Options.sample_dp``)."""
    if cfg.dp_quantile is not None or tuning:
        raise ConfigError("--dp-quantile, --dp-clip-lr and --dp-count-noise adapt DP-FedAvg's clipping norm; "
                          "--dp-level sample clips each sample's gradient to a fixed --dp-clip")
    check_dp_ranges(cfg)
    check_marked(cfg, "sample_dp", f"--dp-level sample: {cfg.algorithm}'s local work is not one minibatch loop of "
                                   f"the client optimizer on its loss alone; DP-SGD composes with")


def check_dp_ranges(cfg: RunConfig) -> None:
    """The clip, the noise multiplier and delta of either DP level in their ranges."""
    check_range("dp_clip", cfg.dp_clip, 0.0, float("inf"), lo_open=True)
    check_range("dp_noise", cfg.dp_noise, 0.0, float("inf"))
    if cfg.dp_delta is not None and not 0 < cfg.dp_delta < 1:
        raise ConfigError(f"dp_delta={cfg.dp_delta!r} is outside (0, 1)")


def check_server_rule(cfg: RunConfig, flag: str, spec: str, parse, off: str, what: str) -> None:
    """A server-side rule's option (``--aggregator``, ``--compression``): a known name with valid parameters
    (``parse``); unless it is ``off``, an averaging algorithm's (``Options.user_dp``: its aggregate is a mean of
    shared parameters alone), and not under user-level DP (whose noise is calibrated to the clipped mean)."""
    name, _ = parse(spec)
    if name == off:
        return
    check_marked(cfg, "user_dp", f"{flag} {spec}: {cfg.algorithm}'s aggregate is not a mean of shared parameters "
                                 f"alone; {what} composes with")
    if cfg.dp_clip is not None and cfg.dp_level == "user":
        raise ConfigError(f"{flag} {spec} with --dp-clip: DP-FedAvg's noise is calibrated to the clipped mean of "
                          f"the updates as sent; use one of the two")


def check_attack(cfg: RunConfig) -> None:
    """``attack`` and ``malicious``: a known attack with valid parameters and a fraction in (0, 1) together
    (neither without the other); an update attack needs an averaging algorithm (``Options.user_dp``)."""
    name, _ = parse_attack(cfg.attack)
    if not (isinstance(cfg.malicious, (int, float)) and 0 <= cfg.malicious < 1):
        raise ConfigError(f"malicious={cfg.malicious!r}: give the fraction of malicious clients, in [0, 1)")
    if name == "none":
        if cfg.malicious:
            raise ConfigError(f"--malicious {cfg.malicious}: malicious clients need an --attack "
                              f"({', '.join(a for a in ATTACKS if a != 'none')})")
        return
    if not cfg.malicious:
        raise ConfigError(f"--attack {cfg.attack}: give the fraction of malicious clients, --malicious F in (0, 1)")
    if name in UPDATE_ATTACKS:
        check_marked(cfg, "user_dp", f"--attack {cfg.attack}: {cfg.algorithm}'s aggregate is not a mean of "
                                     f"shared parameters alone; update attacks compose with")


def check_evaluation(cfg: RunConfig) -> None:
    """The evaluation protocol's options (``jaxfl.run.evaluation``); ConfigError naming the bad one."""
    from ..algorithms import REGISTRY, options_class
    from .evaluation import EVAL_CLIENTS, EVAL_MODELS
    check_choice("eval_model", cfg.eval_model, EVAL_MODELS)
    check_choice("eval_clients", cfg.eval_clients, EVAL_CLIENTS)
    if isinstance(cfg.new_clients, bool) or not isinstance(cfg.new_clients, int) or cfg.new_clients < 0:
        raise ConfigError(f"new_clients={cfg.new_clients!r} must be an integer >= 0 (the clients held out of "
                          f"training; 0: none)")
    if cfg.new_client_steps is not None:
        if isinstance(cfg.new_client_steps, bool) or not isinstance(cfg.new_client_steps, int) or \
                cfg.new_client_steps < 1:
            raise ConfigError(f"new_client_steps={cfg.new_client_steps!r} must be an integer >= 1 (the local steps "
                              f"of a held-out client's update; unset: the run's local epochs)")
        if not cfg.new_clients:
            raise ConfigError(f"--new-client-steps {cfg.new_client_steps}: no client is held out (give "
                              f"--new-clients K), so it would be ignored")
    if cfg.new_clients and options_class(cfg.algorithm).server_client_rows:
        able = ", ".join(n for n, r in REGISTRY.items() if not r.options.server_client_rows)
        raise ConfigError(f"--new-clients {cfg.new_clients}: {cfg.algorithm}'s server keeps a row per training "
                          f"client (read by client id), which a client held out of training does not have; "
                          f"--new-clients applies to {able}")


def check_marked(cfg: RunConfig, mark: str, message: str) -> None:
    """ConfigError "<message>: <the algorithms whose Options set ``mark``>" unless ``cfg``'s algorithm sets it."""
    from ..algorithms import REGISTRY, options_class
    if not getattr(options_class(cfg.algorithm), mark):
        able = ", ".join(n for n, r in REGISTRY.items() if getattr(r.options, mark))
        raise ConfigError(f"{message}: {able}")


def dp_count_noise(cfg: RunConfig, cohort: int) -> float:
    """Adaptive clipping's count noise std sigma_b: ``dp_count_noise``, else 0.05 k with noise (TFF's default),
    0 without. ConfigError if it is too small for the noise multiplier (z < 2 sigma_b is needed)."""
    std = cfg.dp_count_noise if cfg.dp_count_noise is not None else (0.05 * cohort if cfg.dp_noise else 0.0)
    if cfg.dp_noise and not cfg.dp_noise < 2 * std:
        given = "" if cfg.dp_count_noise is not None else f"; default 0.05 x the {cohort} clients a round"
        raise ConfigError(f"--dp-noise {cfg.dp_noise:g} with adaptive clipping needs --dp-count-noise above "
                          f"{cfg.dp_noise / 2:g} (it is {std:g}{given}): the count of clipped updates shares the "
                          f"privacy budget")
    return std


def straggler_work_count(cfg: RunConfig) -> tuple[str, int]:
    """(name, E): what a straggler runs only part of in ``cfg``'s algorithm (``Options.local_work``: the run's
    local epochs, or an option of the method such as FedSelect's ``la_epochs``; an option at 0 falls back to
    the local epochs) and its value."""
    from ..algorithms import options_class
    work = options_class(cfg.algorithm).local_work
    count = getattr(cfg.algorithm_options(), work) if work != "local_epochs" else 0
    return (work, count) if count else ("local_epochs", cfg.local_epochs)


OUTPUTS = ("metrics.jsonl", "summary.json", "accuracy.png", "config.json", "checkpoints")


def check_output(cfg: RunConfig) -> None:
    """Refuse, before any work, an ``out`` that cannot hold the run: a file, a folder that cannot be created
    or written, or a non-empty folder without ``resume`` (continue it) or ``overwrite`` (replace its outputs)."""
    if cfg.out is None:
        return
    if not str(cfg.out).strip():
        raise ConfigError(f"--out {cfg.out!r} is empty; give a folder (it is created if missing)")
    out = Path(cfg.out)
    if out.is_symlink() and not out.exists():  # dangling, or a loop
        raise ConfigError(f"--out {str(out)!r} is a symbolic link to nothing (dangling, or a loop); give a folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder (it is created if missing)")
    if out.is_dir():
        if not writable(out):
            raise ConfigError(f"--out {str(out)!r} is not writable")
        if is_primary():  # another run is writing here (a multi-process run's lock is process 0's)
            check_free(out)
        if holds_files(out) and not (cfg.resume or cfg.overwrite):
            raise ConfigError(f"--out {str(out)!r} is not empty; pass --resume to continue its run, --overwrite "
                              f"to replace it, or choose another folder")
        if cfg.resume and not holds_files(out):
            raise ConfigError(f"--resume: {str(out)!r} is empty: no run to continue (drop --resume to start one)")
        return
    if cfg.resume:
        raise ConfigError(f"--resume: {str(out)!r} does not exist")
    parent = nearest_existing(out.absolute())
    if parent is None or not parent.is_dir() or not writable(parent):
        raise ConfigError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is not a writable folder")


def holds_files(folder: Path) -> bool:
    """Whether ``folder`` holds anything besides a run's lock file (``LOCK_NAME``, left by any run)."""
    return any(p.name != LOCK_NAME for p in folder.iterdir())


def nearest_existing(path: Path) -> Path | None:
    """``path`` if it exists, else its nearest existing parent; None if none exists (a deleted working folder)."""
    return next((p for p in (path, *path.parents) if p.exists()), None)


def writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (a real probe: permission bits do not stop root, read-only
    and virtual file systems do)."""
    import tempfile
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def clear_outputs(out: Path) -> None:
    """Remove a previous run's outputs from ``out`` (``--overwrite``); other files stay."""
    import shutil
    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path`` (atomic: a failed
    write leaves the old file, and no temporary file behind)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# Every RunConfig field in the one group that a reader looks for it in (``config_toml``; a new field must be
# placed: tests/test_runner.py checks that each field is in exactly one group)
CONFIG_GROUPS = {
    "run": ("algorithm", "model", "rounds", "seed"),
    "data": ("dataset", "data_dir", "num_clients", "clients_per_domain", "partition", "dirichlet_alpha",
             "client_sizes", "size_sigma", "classes_per_client", "samples_per_client", "test_per_client",
             "image_size", "channels"),
    "client training": ("optimizer", "lr", "momentum", "weight_decay", "nesterov", "batch_size", "local_epochs"),
    "cohort": ("clients_per_round", "participation", "cohort_sampling", "stragglers", "weighting"),
    "server": ("server_opt", "server_lr", "server_momentum", "server_beta1", "server_beta2", "server_tau",
               "aggregator", "compression", "attack", "malicious"),
    "privacy": ("dp_clip", "dp_level", "dp_noise", "dp_delta", "dp_epsilon", "dp_quantile", "dp_clip_lr",
                "dp_count_noise"),
    "evaluation": ("eval_every", "eval_point", "eval_batch_size", "eval_model", "eval_clients", "new_clients",
                   "new_client_steps"),
    "engine": ("strategy", "backend", "rounds_per_call", "chunk_size", "lane_segments", "lane_overhead", "devices",
               "client_store"),
    "output": ("out", "checkpoint_every", "resume", "overwrite"),
}


def config_toml(cfg: RunConfig) -> str:
    """``cfg`` as a TOML config file (``--config``), its fields under a comment per ``CONFIG_GROUPS`` group and
    the algorithm's options as its table; a field left None (the preset's or backend's choice) is a comment."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)
    d = cfg.to_dict()
    lines = []
    for group, names in CONFIG_GROUPS.items():
        lines.append(f"# -- {group}")
        for name in names:
            if d[name] is not None:
                lines.append(f"{name} = {value(d[name])}")
            else:  # (the model a dataset defaults to is known here; the rest follow the data or the platform)
                lines.append(f"# {name} = (default{': ' + model_name(cfg) if name == 'model' else ''})")
    for algorithm, table in cfg.options.items():
        lines.append(f"\n[{algorithm}]  # its options (jaxfl run --help: --{algorithm}.OPTION)")
        lines += [f"{k} = {value(v)}" for k, v in plain(table).items() if v is not None]
    return "\n".join(lines) + "\n"


def unique_keys(pairs) -> dict:
    """``json.loads``' object hook that refuses a key given twice (as TOML does; JSON would keep the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise json.JSONDecodeError(f"key {key!r} is given twice", "", 0)
        out[key] = value
    return out


def load_config_file(path: str | Path) -> dict:
    """Read a TOML or JSON config file into a dict of RunConfig fields (unknown keys are an error)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text, object_pairs_hook=unique_keys)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ConfigError(f"config file {str(path)!r} is not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table of options, not {type(data).__name__}")
    try:
        RunConfig.from_dict(data)  # unknown keys, named with the file
    except ConfigError as e:
        raise ConfigError(f"{e} (in {str(path)!r})") from None
    return data
