"""jaxfl: vectorized personalized federated learning in JAX.

Layers, each importing only the ones before it: ``errors`` and ``data`` (datasets, partitions, client
arrays) -> ``core`` (the engine) -> ``ops`` (pure building blocks) and ``models`` (Flax modules) ->
``algorithms`` (one file each) -> ``run`` (configuration, CLI, runner, checkpoints, reports).

    from jaxfl import ops                 # masks, losses, evidential, hypernet, gp, qp, clustering, diagnostics
    from jaxfl import build_algorithm, Stacked, LocalTrainer, ClientOptimizer
"""
import os

# jaxlib's CPU LAPACK kernels (batched Cholesky and triangular solves: pFedGP's GPs) already split a batch over
# XLA's threads, and OpenBLAS threads inside each call then oversubscribe the cores: pFedGP's GP step for 5
# clients of 1,000 points took 160 s instead of 18 s on 2 cores. OpenBLAS reads this when jax loads it, so it
# acts only if jaxfl is imported before jax (the CLI and experiments/ do); a value you set is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from . import ops  # noqa: E402
from .algorithms import REGISTRY, build_algorithm, register  # noqa: E402
from .core import (Algorithm, Chunked, ClientMap, ClientOptimizer, ClientStore, Evaluator, LocalTrainer,  # noqa: E402
                   Map, Ragged, RoundInfo, RunContext, Stacked, Step, Streamed, Vmap, client_optimizer, init_state,
                   make_step, normalizer)
from .data import ClientData, RaggedClients, load_dataset  # noqa: E402
from .errors import ConfigError, DataError, JaxflError, NonFiniteError  # noqa: E402
from .run import Experiment, RunConfig, predict_proba, reliability_report, run  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Algorithm", "Chunked", "ClientData", "ClientMap", "ClientOptimizer", "ClientStore", "ConfigError",
           "DataError", "Evaluator", "Experiment", "JaxflError", "LocalTrainer", "Map", "NonFiniteError", "REGISTRY",
           "Ragged", "RaggedClients", "RoundInfo", "RunConfig", "RunContext", "Stacked", "Step", "Streamed", "Vmap",
           "build_algorithm", "client_optimizer", "init_state", "load_dataset", "make_step", "normalizer",
           "ops", "predict_proba", "register", "reliability_report", "run"]
