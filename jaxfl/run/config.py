"""Run configuration: one flat, frozen dataclass, loadable from TOML/JSON and overridable from the CLI."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import tomllib
from pathlib import Path
from typing import ClassVar

from ..core.backends import BACKENDS, PLACEMENTS
from ..core.cohort import SAMPLINGS, STRATEGIES, ClientMap, client_map, default_strategy
from ..core.distributed import is_primary
from ..core.options import accepts_none, check_int_size, coerce, field_type, option, plain
from ..core.privacy import DEFAULT_CLIP_LR, DP_LEVELS
from ..ops.attacks import ATTACKS, UPDATE_ATTACKS, parse_attack
from ..ops.augment import parse_augment
from ..ops.compression import parse_compression
from ..ops.robust_aggregation import parse_aggregator
from ..core.server_opt import DEFAULT_SERVER_LR, SERVER_OPTIMIZERS, server_optimizer
from ..core.step import WEIGHTINGS
from ..core.trainer import OPTIMIZERS
from ..data.federated import (LAZY_INPUTS, MULTILABEL_DATASETS, NORMALIZATIONS, PREFIX_ARGUMENT,
                             RECONSTRUCTION_DATASETS, TEXT_DATASETS, DataConfig)
from ..errors import ConfigError, check_choice, check_range
from .evaluation import EVAL_CLIENTS, EVAL_MODELS
from .lock import LOCK_NAME, check_free


# The values of the protocol fields that neither the config nor the algorithm's ``train_preset`` sets. (An
# algorithm's ``train_preset`` may also name an ``eval_point``: it applies when every client trains every round.)
TRAINING_DEFAULTS = {"batch_size": 64, "lr": 0.01, "momentum": 0.5, "weight_decay": 0.0}


def check_field(name: str, value, meta) -> None:
    """ConfigError naming ``name=value`` unless the value is what its ``option`` metadata allows (run options'
    messages: ``check_choice``'s and ``check_range``'s)."""
    if value is None:
        return
    if meta.get("choices") is not None:
        check_choice(name, value, meta["choices"])
    if meta.get("minimum") is not None and value < meta["minimum"]:
        hint = f" ({meta['hint']})" if meta.get("hint") else ""
        raise ConfigError(f"{name}={value} must be at least {meta['minimum']}{hint}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None or hi is not None:
        check_range(name, value, -math.inf if lo is None else lo, math.inf if hi is None else hi,
                    lo_open=meta.get("lo_open", False))


@dataclasses.dataclass(frozen=True)
class ConfigGroup:
    """A group of run options; ``RunConfig`` is every group together (it subclasses each, so a function that
    needs one group takes that group's type and is given the whole config). Each field is declared once, with
    ``option``: the CLI's flags and ``--help``, ``--print-config``'s sections, the config files' keys and the
    per-field checks are made from the declarations. ``check`` holds the checks across the group's own fields;
    checks that read several groups are ``validate``'s."""
    title: ClassVar[str] = ""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The group's own fields, in declaration order."""
        own = inspect.get_annotations(cls)
        return tuple(f.name for f in dataclasses.fields(cls) if f.name in own)

    @classmethod
    def validate_fields(cls, cfg: "ConfigGroup") -> None:
        """ConfigError naming the first of this group's fields of ``cfg`` outside its declared values, then the
        group's ``check`` (``cfg``: this group or a RunConfig)."""
        declared = {f.name: f for f in dataclasses.fields(cls)}
        for name in cls.names():
            check_field(name, getattr(cfg, name), declared[name].metadata)
        cls.check(cfg)

    def check(self) -> None:
        """The group's checks across its own fields (ConfigError); a group overrides it."""


@dataclasses.dataclass(frozen=True)
class Run(ConfigGroup):
    title = "run"
    algorithm: str = option("fedbn")  # (help and choices from the registry: cli.generated_help, validate)
    model: str | None = None
    rounds: int = option(10, "communication rounds", minimum=1)
    seed: int = option(0, "the run's seed: the data split, the initial model, each round's cohort and every "
                              "client's minibatch orders", minimum=0)


@dataclasses.dataclass(frozen=True)
class Data(ConfigGroup):
    title = "data"
    dataset: str = "default"
    data_dir: str | None = option(None, "folder with the .npz benchmarks (default: $JAXFL_DATA_DIR)")
    num_clients: int | None = option(None, "clients of a label-split dataset (mnist, cifar10, tfds:*); tff_*: "
                                               "the first N", minimum=1)
    clients_per_domain: int = option(1, "domain datasets (default, digits, pacs, folder:*): split each "
                                            "domain into this many clients", minimum=1)
    partition: str | None = option(None, "how a label-split dataset is divided: iid | dirichlet | shards | "
                                             "dirichlet_quantity")
    dirichlet_alpha: float = option(0.5, "dirichlet partitions: the concentration alpha of each client's "
                                             "label distribution", lo=0.0, lo_open=True)
    client_sizes: str = option("equal", "dirichlet_quantity: client sizes equal | lognormal (then each "
                                             "client's labels ~ Dir(alpha p))", choices=("equal", "lognormal"))
    size_sigma: float = option(0.5, "dirichlet_quantity with lognormal sizes: sigma of the log client size",
                                   lo=0.0)
    classes_per_client: int = option(2, "shards partition: the classes each client holds")
    samples_per_client: int | None = option(None, "cap each client's training samples", minimum=1)
    test_per_client: int | None = option(None, "cap each client's test samples", minimum=1)
    image_size: int | None = option(None, "resize images to this many pixels a side (default: the dataset's "
                                              "own size)", minimum=1)
    channels: int = option(3, "the channels images are converted to: 3 (grey repeated to RGB) or 1 (RGB to "
                                  "grey by 601 luma)")
    lazy_inputs: str = option("auto", "natural-client image files (tff_emnist:, tff_cifar100:, flair:): read a "
                                      "client's inputs from the file each time a round or an evaluation uses "
                                      "them (yes), all at load (no), or auto: yes where they would take more "
                                      "than a quarter of the host's memory", choices=LAZY_INPUTS)
    normalize: str = option("dataset", "how uint8 images are scaled: dataset (its own: (x/255 - 0.5)/0.5 for most) "
                                       "| imagenet (torchvision's per-channel ImageNet mean and std; 3 channels) | "
                                       "cifar10 (the per-channel CIFAR-10 statistics FedTP's code uses; 3 channels) "
                                       "| unit (x/255)", choices=("dataset", *NORMALIZATIONS))

    def check(self) -> None:
        check_data_options(self)


@dataclasses.dataclass(frozen=True)
class ClientTraining(ConfigGroup):
    title = "client training"
    optimizer: str = option("sgd", "client optimizer: sgd | adam (PyTorch semantics)", choices=OPTIMIZERS)
    # None: the algorithm's protocol (``train_preset``: what its official code trains with), else TRAINING_DEFAULTS
    lr: float | None = option(None, "client learning rate", lo=0.0, lo_open=True)
    momentum: float | None = option(None, "client SGD momentum", lo=0.0, hi=1.0)
    weight_decay: float | None = option(None, "client weight decay, added to the gradient as torch does", lo=0.0)
    nesterov: bool = option(False, "sgd: Nesterov momentum")
    batch_size: int | None = option(None, "client minibatch size", minimum=1)
    local_epochs: int = option(1, "local epochs of each client's training in a round", minimum=1)
    augment: str = option(
        "none", "training-time image augmentation of every local minibatch (jaxfl.ops.augment; images only): none | "
                "crop_flip[:pad=4] (zero-pad, random crop, horizontal flip: FedSelect's CIFAR-10 and DapperFL's "
                "official code) | flip_rotate[:degrees=30] (horizontal flip, random rotation: FedPick's and "
                "RFedDis's Office/DomainNet) | flip")

    def check(self) -> None:
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum):
            raise ConfigError("--nesterov needs --optimizer sgd with --momentum > 0")
        parse_augment(self.augment)


@dataclasses.dataclass(frozen=True)
class Cohort(ConfigGroup):
    title = "cohort"
    clients_per_round: int | None = option(None, "clients sampled per round (default: every client)", minimum=1)
    participation: float | None = option(None, "fraction of clients sampled per round", lo=0.0, hi=1.0,
                                             lo_open=True)
    # fixed: exactly k clients a round (without replacement) | poisson: each client with probability k / N
    cohort_sampling: str = option(
        "fixed", "fixed (exactly --clients-per-round / --participation of the clients each round, drawn without "
                 "replacement) | poisson (each client joins a round with probability q = that fraction, "
                 "independently: a cohort of Binomial(N, q) clients, the sampling DP-FedAvg's add/remove "
                 "accounting assumes)", choices=SAMPLINGS)
    stragglers: float = option(
        0.0, "systems heterogeneity (FedProx): the chance that a client of the round is a straggler, which runs a "
             "uniformly random 1..E-1 of its E local epochs (of each local training phase; FedSelect: its LocalAlt "
             "alternations, pFedHN and pFedGP: their inner steps); 0: none", lo=0.0, hi=1.0)
    weighting: str = option("samples", "how the cohort's models are weighted in the aggregate: by training "
                                           "samples | uniform", choices=WEIGHTINGS)


@dataclasses.dataclass(frozen=True)
class Server(ConfigGroup):
    title = "server"
    server_opt: str = option(
        "none", "server optimizer of the averaging algorithms (FedOpt: the cohort's mean as a pseudo-gradient "
                "step): none (the plain mean) | sgd (with --server-momentum: FedAvgM) | adagrad | adam | yogi",
        choices=SERVER_OPTIMIZERS)
    server_lr: float | None = option(None, "server learning rate (default: 1 for sgd, 0.1 for adagrad, 0.01 "
                                               "for adam and yogi)", lo=0.0, lo_open=True)
    server_momentum: float = option(0.0, "server sgd momentum (FedAvgM)", lo=0.0, hi=1.0)
    server_beta1: float = option(0.9, "adagrad/adam/yogi: first-moment decay", lo=0.0, hi=1.0)
    server_beta2: float = option(0.99, "adam/yogi: second-moment decay", lo=0.0, hi=1.0)
    server_tau: float = option(1e-3, "adagrad/adam/yogi: adaptivity tau (added to sqrt(v))", lo=0.0,
                                   lo_open=True)
    aggregator: str = option(
        "mean", "robust aggregation of the averaging algorithms' shared parameters, over the cohort's updates "
                "(jaxfl.ops.robust_aggregation): mean (the algorithm's own) | median | trimmed_mean[:beta=0.1] | "
                "krum[:f=1] | multi_krum[:f=1,m=0 (k - f)] | bulyan[:f=1] | geometric_median[:iters=8] | "
                "norm_bound[:bound=1.0] | centered_clip[:tau=1.0,iters=1]")
    compression: str = option(
        "none", "how clients encode their update of the shared parameters (averaging algorithms; "
                "jaxfl.ops.compression): none | topk[:fraction=0.01] | randk[:fraction=0.1] | "
                "quantize[:bits=4,rotate=0 (1: Walsh-Hadamard rotation first)] | qsgd[:levels=16] | sign; each "
                "takes feedback=1 (error feedback: a client keeps its residual; randk and qsgd are then scaled by "
                "1/(1+variance) to be contractive); metrics.jsonl logs each client's upload_bits")
    attack: str = option(
        "none", "what the malicious clients do (jaxfl.ops.attacks): none | sign_flip[:scale=1] | scale[:scale=10] "
                "(model replacement) | gaussian[:std=1] | alie[:z=0 (from the cohort)] | ipm[:eps=0.5] (update "
                "attacks, averaging algorithms) | label_flip (their training labels y -> C-1-y) | "
                "backdoor[:target=0,fraction=0.5,size=3] (a white square on a share of their images, relabelled "
                "target; metrics.jsonl logs backdoor_accuracy)")
    malicious: float = option(0.0, "the fraction of clients that are malicious, fixed for the run (drawn from "
                                       "--seed)")


@dataclasses.dataclass(frozen=True)
class Privacy(ConfigGroup):
    """Differential privacy (``jaxfl.core.privacy``); its checks read the algorithm and the weighting, so they
    are ``validate``'s (``check_privacy``)."""
    title = "privacy"
    dp_clip: float | None = option(
        None, "user-level differential privacy (DP-FedAvg) of the averaging algorithms: clip each client's update "
              "of the shared parameters to this l2 norm C (needs --weighting uniform; default: off)")
    # user: DP-FedAvg (a client's update clipped); sample: DP-SGD in local training (each sample's gradient
    # clipped to dp_clip, noise z C on a step's sum; ``jaxfl.core.dpsgd``)
    dp_level: str = option(
        "user", "user: DP-FedAvg (above); sample: DP-SGD in every client's local training (Poisson-sampled batches "
                "of rate 1/steps, each sample's gradient clipped to --dp-clip, Gaussian noise of std --dp-noise x C "
                "on a step's sum; needs a model without BatchNorm; any --weighting; epsilon per sample, each round "
                "amplified by a fixed-size cohort's draw where clients keep no state, else every client counted "
                "every round)", choices=DP_LEVELS)
    dp_noise: float = option(
        0.0, "DP-FedAvg noise multiplier z: Gaussian noise of std z*C/k on the mean of the cohort's k clipped "
             "updates (with --cohort-sampling poisson: z*C/(qN) on their sum over qN); the run reports (epsilon, "
             "delta) by an RDP accountant (0: clipping only)")
    dp_delta: float | None = option(None, "the delta of the reported epsilon (default: N^-1.1 for N clients; "
                                              "--dp-level sample: for N training samples)")
    dp_epsilon: float | None = option(
        None, "DP-FedAvg: calibrate the noise: the smallest --dp-noise whose run spends at most this epsilon (at "
              "--dp-delta, over --rounds; the start-up line and config.json give the multiplier found)")
    dp_quantile: float | None = option(
        None, "DP-FedAvg with adaptive clipping (Andrew et al. 2021): the clipping norm starts at --dp-clip and "
              "tracks this quantile of the clients' update norms, counted privately (default: fixed clipping)")
    dp_clip_lr: float = option(DEFAULT_CLIP_LR, "adaptive clipping: learning rate of the geometric update "
                                                    "C <- C exp(-lr (unclipped - quantile))")
    dp_count_noise: float | None = option(
        None, "adaptive clipping: std of the noise on the count of unclipped updates (default: 0.05 x the clients "
              "per round when --dp-noise > 0; the update's noise grows so that the round's privacy is fixed "
              "clipping's at --dp-noise)")


# The evaluation batch size by default (``benchmarks/eval_batch.py``, one core; benchmarks/RESULTS.md, "The
# evaluation batch size per model"). On a CPU a batch's activations should stay in cache: the convolutional and
# attention models evaluate fastest at 16 or within 6 % of it (the ViTs 1.15-1.37x slower at 64-128, 1.3-2.5x at
# 256; the smallest models gain 1.1-1.5x at larger batches, at microseconds a sample). Models whose large dense
# layers are read once a batch evaluate faster at a larger one, at their measured best: FEMNIST CNN 1.25x and the
# digits CNN 1.2x at 64, AlexNet 1.6x at 128, against 16. An accelerator wants large batches.
CPU_EVAL_BATCH, ACCELERATOR_EVAL_BATCH = 16, 256
CPU_EVAL_BATCH_BY_MODEL = {"femnist_cnn": 64, "digits_cnn": 64, "alexnet_bn": 128}


@dataclasses.dataclass(frozen=True)
class Evaluation(ConfigGroup):
    title = "evaluation"
    eval_every: int = option(1, "evaluate every N rounds (and after the last)", minimum=1)
    eval_point: str | None = option(
        None, "aggregated (each client's model after the round) | local (right after its local training, before "
              "aggregation, as FedSelect's code evaluates; needs every client in every round) (default: "
              "aggregated; local for fedselect when every client trains every round, its official protocol)",
        choices=("aggregated", "local"))
    eval_batch_size: int | None = option(
        None, f"evaluation batch size (default on a CPU: {CPU_EVAL_BATCH}, where a small batch's activations stay in "
              f"cache (the CNNs and ViTs measured evaluate 1.3-2.5x faster than at 256), and "
              f"{', '.join(f'{b} for {m}' for m, b in CPU_EVAL_BATCH_BY_MODEL.items())}, whose large dense layers "
              f"are read once a batch (1.2-1.6x faster than at {CPU_EVAL_BATCH}); {ACCELERATOR_EVAL_BATCH} on an "
              f"accelerator; config.json saves the size used)", minimum=1)
    eval_tail_batches: str = option(
        "auto", "map: a client's partial last test batch computed at the smallest eighth of B that holds it "
                "(B: the evaluation batch size; the same predictions up to float rounding, with fewer than "
                "max(B/8, 2) padded samples where B would pad it to B; only the sizes the clients' last batches take): "
                "auto (when that cuts the computed test samples over the population by 10% "
                "or more; config.json saves what auto chose) | on | off (every batch at B)",
        choices=("auto", "on", "off"))
    # evaluation protocols (``jaxfl.run.evaluation``): which model, which clients, and clients held out of training
    eval_model: str = option(
        "personal", "which model each evaluation tests: personal (each client's own state) | global (the server's "
                    "own model, for methods whose server holds one) | both (personal in test_*/mean_accuracy, "
                    "global in global_* fields)", choices=EVAL_MODELS)
    eval_clients: str = option(
        "all", "which clients each evaluation tests: all | cohort (those that trained in the evaluated round; the "
               "others are null in the per-client lists and out of the means)", choices=EVAL_CLIENTS)
    new_clients: int = option(
        0, "hold K clients out of training (drawn from --seed) and evaluate them at every evaluation: with the "
           "global model (new_* fields, where the server holds one) and, for methods that predict with a "
           "just-trained model, after one local update from where a new client starts (new_tuned_* fields); 0: "
           "none")
    new_client_steps: int | None = option(
        None, "--new-clients: the held-out clients' local update runs at most this many local steps (minibatches; "
              "methods with their own local loop, FedSelect, pFedHN, pFedGP, keep it) (default: the run's "
              "--local-epochs)")

    def check(self) -> None:
        check_new_clients(self)


@dataclasses.dataclass(frozen=True)
class Engine(ConfigGroup):
    title = "engine"
    strategy: str | None = option(
        None, "vmap | map | chunked (default: map on CPU, vmap on GPU/TPU); on the stacked backend vmap and "
              "chunked sort the cohort by local steps and run chunks of lanes (--lane-segments)", choices=STRATEGIES)
    backend: str | None = option(
        None, "stacked (the whole population on the device, one jitted call per round) | streamed (samples and "
              "states on the host, each cohort sent to the device as a store sized up front and trained in one "
              "call: one program) | ragged (samples on the host, the cohort trained in buckets of similar clients) "
              "(default: stacked when the population fits in a quarter of each device's memory and its clients "
              "are even, or a lane plan runs them (--lane-segments > 0), or, on an accelerator, the run is "
              "modelled to finish sooner with one call per round (its rounds and the programs each backend "
              "compiles: jaxfl.core.cost); else streamed where one call wastes little, ragged where it would or "
              "over several processes; the start-up line names the choice)", choices=BACKENDS)
    rounds_per_call: int = option(1, "stacked backend: rounds run in one jitted call (the host acts between "
                                         "calls)", minimum=1)
    chunk_size: int = option(8, "chunked: clients per chunk", minimum=1)
    lane_segments: int = option(
        3, "stacked and streamed backends under vmap/chunked: the cohort is sorted by local steps inside the round "
           "and run as chunks of lanes, each to its own longest client, in at most this many segments of equal "
           "chunks (jaxfl.core.lanes; 0: one vmap over the cohort, every lane to its longest client)", minimum=0,
        hint="0: one vmap call over the cohort")
    lane_overhead: float | None = option(
        None, "the cost of one sequential local step in lane-steps that the lane plan weighs against padded lanes "
              "(default: 0 on CPU; on an accelerator derived from jaxfl.core.cost, tau P / (B f), at most 32)", lo=0.0)
    tail_batches: str = option(
        "auto", "map: a client's partial last batch computed at the smallest eighth of B that holds its "
                "samples (the same step up to float rounding, with fewer than max(B/8, 2) padded samples where B "
                "would pad it to B; not with --augment, DP-SGD or a loss that draws from its key, which keep B; "
                "each size the clients' last batches take is one more branch of the step to compile): "
                "auto (when that cuts an epoch's computed samples by 10% or more; "
                "config.json saves what auto chose) | on | off (every step at B)", choices=("auto", "on", "off"))
    devices: int | None = option(
        None, "split the clients over this many devices (0: all; clients per round must divide evenly); on a CPU, "
              "N > 1 runs N CPU devices, one block of clients per core (default: on a CPU, one device per core, "
              "the most that divide the cohort; on an accelerator 1)", minimum=0,
        hint="0: all devices, 1: no sharding; unset: on a CPU one device per core when the cohort splits evenly")
    client_store: str = option("auto", "where per-client persistent state lives: auto (device if it fits in a "
                                           "quarter of its memory) | device | host", choices=PLACEMENTS)

    def check(self) -> None:
        if self.rounds_per_call > 1 and self.backend in ("ragged", "streamed"):
            raise ConfigError(f"rounds_per_call={self.rounds_per_call} keeps rounds on the device: it needs "
                              f"--backend stacked (or the default, which picks stacked when the population fits)")


@dataclasses.dataclass(frozen=True)
class Output(ConfigGroup):
    title = "output"
    out: str | None = option(None, "output folder: metrics.jsonl, summary.json, accuracy.png, config.json, "
                                       "checkpoints/ (default: a new runs/<algorithm>-<dataset>-<time>); a non-empty "
                                       "folder needs --resume or --overwrite")
    checkpoint_every: int = option(0, "save a checkpoint every N rounds (0: never)", minimum=0)
    resume: bool = option(False, "continue from the newest checkpoint in --out")
    overwrite: bool = option(False, "replace the outputs of the run already in --out")

    def check(self) -> None:
        if (self.resume or self.checkpoint_every) and not self.out:
            raise ConfigError("checkpoints and --resume need an output directory (--out DIR)")
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --out, --overwrite replaces it: give one of them")


# The groups in the order --help, --print-config and a saved config.json list them
GROUPS: tuple[type[ConfigGroup], ...] = (Run, Data, ClientTraining, Cohort, Server, Privacy, Evaluation, Engine,
                                         Output)


@dataclasses.dataclass(frozen=True)
class RunConfig(Output, Engine, Evaluation, Privacy, Server, Cohort, ClientTraining, Data, Run):
    """Everything a run depends on: every ``GROUPS`` group's options (``None`` means "the preset's / backend's
    default") and the algorithms' option tables. (The bases are listed last group first: a dataclass orders the
    inherited fields from its last base.)"""
    title = ""
    # algorithm options by algorithm, e.g. {"fedselect": {"alpha": 0.5}}: each algorithm's Options dataclass
    # (``jaxfl.algorithms``) owns its defaults, presets and checks; the CLI's --fedselect.alpha, a [fedselect]
    # table in TOML. The run uses only the table of ``algorithm``.
    options: dict = dataclasses.field(default_factory=dict)


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

    def client_map(self, mesh=None) -> ClientMap:
        """How the run's calls run their clients (``core.cohort.ClientMap``): ``strategy_or_default`` with
        ``chunk_size``, the client axis split over ``mesh`` (the run's placement, ``build.client_placement``;
        None: one device)."""
        return client_map(self.strategy_or_default(), self.chunk_size, mesh)

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


# a dataset's model when neither --model nor the algorithm names one (a key ending in ":" is a prefix)
DEFAULT_MODEL = {"default": "digits_cnn", "digits": "digits_cnn", "pacs": "digits_cnn",
                 "tff_stackoverflow_tags:": "bow_logreg", "tff_emnist_ae:": "emnist_ae"}


def model_name(cfg: RunConfig) -> str:
    """--model, else the first model the algorithm allows, else the dataset's default (``DEFAULT_MODEL``;
    small_cnn otherwise, char_lstm for text)."""
    from ..algorithms import options_class
    allowed = options_class(cfg.algorithm).models
    prefixed = [m for key, m in DEFAULT_MODEL.items() if key.endswith(":") and cfg.dataset.startswith(key)]
    default = DEFAULT_MODEL.get(cfg.dataset) or (prefixed[0] if prefixed else
                                                 "char_lstm" if is_text(cfg.dataset) else "small_cnn")
    return cfg.model or (allowed[0] if allowed else default)


def is_text(dataset: str) -> bool:
    """Whether ``dataset`` holds token ids (``TEXT_DATASETS``) rather than images."""
    return any(dataset.startswith(t) for t in TEXT_DATASETS)


def check_modality(cfg: RunConfig) -> None:
    """ConfigError unless the run's model reads what its dataset holds: token ids (``models.TEXT_MODELS``) or
    images (every other model); image augmentation only on images."""
    from ..algorithms import options_class
    from ..models import TEXT_MODELS
    model, text = model_name(cfg), is_text(cfg.dataset)
    if text and parse_augment(cfg.augment)[0] != "none":
        raise ConfigError(f"--augment {cfg.augment}: --dataset {cfg.dataset} holds text (token ids); image "
                          f"augmentation applies to image datasets only (use --augment none)")
    if text and model not in TEXT_MODELS:
        allowed = options_class(cfg.algorithm).models
        which = (f"--model {model} reads images" if cfg.model is not None or not allowed else
                 f"{cfg.algorithm} runs on images only (its models: {', '.join(allowed)})")
        raise ConfigError(f"--dataset {cfg.dataset} holds text (token ids) and {which}; text needs --model "
                          f"{' or '.join(TEXT_MODELS)}")
    labels = ("multi-label task (multi-hot labels)" if any(cfg.dataset.startswith(p) for p in MULTILABEL_DATASETS)
              else "reconstruction task (float targets)"
              if any(cfg.dataset.startswith(p) for p in RECONSTRUCTION_DATASETS) else None)
    if labels:
        from ..algorithms import REGISTRY
        if not options_class(cfg.algorithm).multilabel:  # (the methods that read labels only through the loss)
            able = sorted(n for n in REGISTRY if options_class(n).multilabel)
            raise ConfigError(f"--dataset {cfg.dataset} is a {labels} and {cfg.algorithm} reads its labels as "
                              f"class ids; such runs need an algorithm whose loss is the per-sample loss of "
                              f"jaxfl.core.metrics: {', '.join(able)}")
        attack = parse_attack(cfg.attack)[0]
        if attack not in ("none", *UPDATE_ATTACKS):
            raise ConfigError(f"--attack {cfg.attack} changes class labels, and --dataset {cfg.dataset} is a "
                              f"{labels}; use an update attack ({', '.join(UPDATE_ATTACKS)})")
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
                ("tff_emnist:", "tff_shakespeare:", "tff_cifar100:", "tff_stackoverflow:", "tff_stackoverflow_tags:",
                 "flair:"), ("num_clients",)),
}


def dataset_names(names) -> str:
    """"mnist, tfds:NAME": dataset names as --help writes them (a prefix with what follows it)."""
    return ", ".join(n + PREFIX_ARGUMENT.get(n, "") for n in names)


def dataset_kind(dataset: str) -> str | None:
    """``DATASET_KINDS``' key of a dataset name (None for an unknown one: loading names the valid ones)."""
    return next((kind for kind, (_, names, _) in DATASET_KINDS.items()
                 if any(dataset == n or (n.endswith(":") and dataset.startswith(n)) for n in names)), None)


def check_data_options(cfg: Data) -> None:
    """ConfigError for a data option set (away from its default) that the dataset's split does not read, e.g.
    --partition on a domain dataset (it would be ignored)."""
    kind = dataset_kind(cfg.dataset)
    if kind is None:
        return
    default = Data()
    for name in sorted({f for _, _, fields in DATASET_KINDS.values() for f in fields} - set(DATASET_KINDS[kind][2])):
        if getattr(cfg, name) != getattr(default, name):
            users = [k for k, (_, _, fields) in DATASET_KINDS.items() if name in fields]
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: --dataset {cfg.dataset} "
                              f"{DATASET_KINDS[kind][0]}, so it would be ignored; it applies to "
                              f"{', '.join(dataset_names(DATASET_KINDS[k][1]) for k in users)}")


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigError naming the first bad value; otherwise return cfg with its protocol fields resolved
    (``RunConfig.with_protocol``). Every field's type; then group by group (``GROUPS``) its fields' declared
    values and the group's own checks; then the checks across groups (the algorithm's abilities above all)."""
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
    for group in GROUPS:
        group.validate_fields(cfg)
    if cfg.new_clients and options_class(cfg.algorithm).server_client_rows:
        able = ", ".join(n for n, r in REGISTRY.items() if not r.options.server_client_rows)
        raise ConfigError(f"--new-clients {cfg.new_clients}: {cfg.algorithm}'s server keeps a row per training "
                          f"client (read by client id), which a client held out of training does not have; "
                          f"--new-clients applies to {able}")
    if cfg.server_opt != "none":
        check_marked(cfg, "server_optimizer", f"--server-opt {cfg.server_opt}: {cfg.algorithm}'s aggregate is not a "
                                              f"mean of shared parameters; a server optimizer composes with")
    check_server_rule(cfg, "--aggregator", cfg.aggregator, parse_aggregator, "mean", "a robust aggregator")
    check_attack(cfg)
    check_server_rule(cfg, "--compression", cfg.compression, parse_compression, "none", "update compression")
    check_privacy(cfg)
    if cfg.cohort_sampling == "poisson" and not options_class(cfg.algorithm).poisson_sampling:
        unable = ", ".join(n for n, r in REGISTRY.items() if not r.options.poisson_sampling)
        raise ConfigError(f"--cohort-sampling poisson pads each round's cohort with rows of weight 0, which "
                          f"{cfg.algorithm}'s aggregate does not treat as absent (algorithms without Poisson "
                          f"sampling: {unable}); use --cohort-sampling fixed")
    if parse_augment(cfg.augment)[0] != "none" and options_class(cfg.algorithm).own_minibatches:
        unable = ", ".join(n for n, r in REGISTRY.items() if r.options.own_minibatches)
        raise ConfigError(f"--augment {cfg.augment}: {cfg.algorithm}'s local training draws its minibatches in a "
                          f"loop of its own, which augmentation does not reach (algorithms without --augment: "
                          f"{unable})")
    if cfg.stragglers:
        work, count = straggler_work_count(cfg)
        if count < 2:
            flag = work.replace("_", "-") if work == "local_epochs" else f"{cfg.algorithm}.{work.replace('_', '-')}"
            raise ConfigError(f"stragglers={cfg.stragglers}: a straggler runs 1 to E-1 of its E {work}, so "
                              f"--{flag} must be at least 2 (it is {count})")
    for name, table in cfg.options.items():  # every table given, not only the run's: a typo is caught
        check_choice("algorithm table", name, REGISTRY)
        algorithm_options(name, table, cfg.dataset)
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


def check_new_clients(cfg: Evaluation) -> None:
    """``new_clients`` (an integer >= 0) and ``new_client_steps`` (an integer >= 1, only with held-out clients)."""
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
    for above in out.absolute().parents:  # (a folder cannot be made below a link to nothing)
        if above.is_symlink() and not above.exists():
            raise ConfigError(f"--out {str(out)!r} is below {str(above)!r}, a symbolic link to nothing (dangling, or "
                              f"a loop); give a folder elsewhere")
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
        raise ConfigError(f"--resume: {str(out)!r} does not exist: no run to continue (drop --resume, or after "
                          f"--config a run's config.json that has resume = true pass --no-resume, to start one)")
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


# Every RunConfig field under the title of the one group that declares it (``config_toml``, ``--help``)
CONFIG_GROUPS = {group.title: group.names() for group in GROUPS}


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
