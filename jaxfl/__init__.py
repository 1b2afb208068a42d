"""jaxfl: vectorized personalized federated learning in JAX.

Pure building blocks (masks, aggregation, hypernetwork, evidential losses, metrics) live in
``jaxfl.blocks`` and are re-exported here.
"""
import os

# jaxlib's CPU LAPACK kernels (batched Cholesky and triangular solves: pFedGP's GPs) already split a batch over
# XLA's threads, and OpenBLAS threads inside each call then oversubscribe the cores: pFedGP's GP step for 5
# clients of 1,000 points took 160 s instead of 18 s on 2 cores. OpenBLAS reads this when jax loads it, so it
# acts only if jaxfl is imported before jax (the CLI and experiments/ do); a value you set is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from . import aggregation, blocks  # noqa: E402, evidential, hypernet, losses, masks, metrics, models, reliability
from .algorithms import ALGORITHMS, build_algorithm
from .blocks import *  # noqa: F401,F403  (the documented pure-function API)
from .engine import (Algorithm, ClientData, LocalTrainer, RoundInfo, init_state, make_evaluate, make_predict,
                     make_round, map_clients)
from .reliability import predict_proba, reliability_report
from .errors import ConfigError, DataError, JaxflError, NonFiniteError

__version__ = "0.1.0"
