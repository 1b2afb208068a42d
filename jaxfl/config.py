"""Run configuration: one flat, frozen dataclass, loadable from TOML/JSON and overridable from the CLI."""
from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

from .data.federated import DataConfig
from .engine import STRATEGIES
from .errors import ConfigError, check_choice, check_range


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on. ``None`` means "the preset's / backend's default"."""
    algorithm: str = "fedbn"
    dataset: str = "default"
    model: str | None = None
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.5
    seed: int = 0
    # algorithm options (each algorithm reads the ones it takes; see jaxfl.algorithms)
    prox_mu: float = 0.01
    ditto_lambda: float = 0.1
    head_epochs: int = 4
    warmup_rounds: int = 0
    local_bn: bool = False
    # fedpick (None: the paper's value for the dataset)
    tau: float | None = None
    lam_lce: float | None = None
    lam_ent: float | None = None
    lam_dis: float | None = None
    use_pfsm: bool = True
    soft_mask: bool = False
    no_ensemble: bool = False
    share_bn: bool = False
    share_pfsm: bool = False
    pfsm_head: str = "same"
    # rfeddis (the annealing horizon is ``rounds``)
    share_global_head: bool = True
    use_local_head: bool = True
    use_dis: bool = True
    head_ce: bool = True
    fusion: str = "ds"
    kl_reduction: str = "mean_all"
    dis_feature: str = "relu1"
    # fedselect (T of "no aggregation in the last round" is ``rounds``)
    alpha: float = 0.8
    grow_rate: float = 0.25
    grow_every: int = 3
    la_epochs: int = 1
    delta_ref: str = "snapshot"
    weight_by_n: bool = False
    mask_biases: bool = False
    aggregate_batch_stats: bool = False
    # fedtp (the embedding table has one row per client of the dataset)
    fedtp_variant: str = "hypernet"
    personalize: bool = True
    embed_dim: int = 128
    hyper_hidden: int = 150
    hyper_layers: int = 3
    hyper_lr: float = 0.01
    hyper_momentum: float = 0.9
    hyper_decay: float = 1e-3
    # dapperfl (E = local_epochs: 1 dense + E - 1 masked)
    device_ratios: tuple = (0.0, 0.2, 0.4, 0.6, 0.8)
    gamma: float = 0.01
    use_fusion: bool = True
    recover_mode: str = "global"
    dar_norm: str = "l2"
    alpha0: float = 0.9
    alpha_min: float = 0.1
    fusion_eps: float = 0.2
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
    weighting: str = "samples"
    strategy: str | None = None
    chunk_size: int = 8
    devices: int = 1
    client_store: str = "auto"
    eval_every: int = 1
    eval_batch_size: int = 256
    # output
    out: str | None = None
    checkpoint_every: int = 0
    resume: bool = False

    def data_config(self) -> DataConfig:
        names = {f.name for f in dataclasses.fields(DataConfig)}
        return DataConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        """Plain JSON types (tuples as lists, so a saved config compares equal after loading)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigError naming the first bad value; return cfg unchanged otherwise."""
    from .algorithms import ALGORITHMS
    from .models import MODELS
    check_choice("algorithm", cfg.algorithm, ALGORITHMS)
    if cfg.model is not None:
        check_choice("model", cfg.model, MODELS)
    if cfg.strategy is not None:
        check_choice("strategy", cfg.strategy, STRATEGIES)
    check_choice("weighting", cfg.weighting, ("samples", "uniform"))
    check_choice("client_store", cfg.client_store, ("auto", "device", "host"))
    check_choice("client_sizes", cfg.client_sizes, ("equal", "lognormal"))
    if cfg.size_sigma < 0:
        raise ConfigError(f"size_sigma={cfg.size_sigma} must be >= 0")
    check_choice("pfsm_head", cfg.pfsm_head, ("same", "linear"))
    check_choice("fusion", cfg.fusion, ("ds", "sum"))
    check_choice("kl_reduction", cfg.kl_reduction, ("mean_all", "batchmean"))
    check_choice("delta_ref", cfg.delta_ref, ("snapshot", "round_start"))
    check_choice("fedtp_variant", cfg.fedtp_variant, ("hypernet", "vanilla"))
    check_choice("recover_mode", cfg.recover_mode, ("global", "zero"))
    check_choice("dar_norm", cfg.dar_norm, ("l2", "sq_l2"))
    for r in cfg.device_ratios:
        check_range("device_ratios entry", r, 0.0, 1.0)
    check_range("alpha", cfg.alpha, 0.0, 1.0)
    check_range("grow_rate", cfg.grow_rate, 0.0, 1.0)
    if cfg.tau is not None and cfg.tau <= 0:
        raise ConfigError(f"tau={cfg.tau} must be > 0")
    for name in ("rounds", "local_epochs", "batch_size", "chunk_size", "eval_every",
                 "eval_batch_size", "clients_per_domain", "grow_every", "la_epochs"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be at least 1")
    check_range("lr", cfg.lr, 0.0, float("inf"), lo_open=True)
    check_range("momentum", cfg.momentum, 0.0, 1.0)
    for name in ("prox_mu", "ditto_lambda", "head_epochs", "warmup_rounds", "lam_lce", "lam_ent", "lam_dis"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.participation is not None:
        check_range("participation", cfg.participation, 0.0, 1.0, lo_open=True)
    if cfg.clients_per_round is not None and cfg.clients_per_round < 1:
        raise ConfigError(f"clients_per_round={cfg.clients_per_round} must be at least 1")
    if cfg.devices < 0:
        raise ConfigError(f"devices={cfg.devices} must be >= 0 (0: all devices, 1: no sharding)")
    if cfg.checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every={cfg.checkpoint_every} must be >= 0")
    if (cfg.resume or cfg.checkpoint_every) and not cfg.out:
        raise ConfigError("checkpoints and --resume need an output directory (--out DIR)")
    return cfg


def load_config_file(path: str | Path) -> dict:
    """Read a TOML or JSON config file into a dict of RunConfig fields (unknown keys are an error)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    known = {f.name for f in dataclasses.fields(RunConfig)}
    bad = sorted(set(data) - known)
    if bad:
        raise ConfigError(f"unknown config keys {bad} in {str(path)!r}; valid: {', '.join(sorted(known))}")
    return data
