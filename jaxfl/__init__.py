"""jaxfl: vectorized personalized federated learning in JAX.

Pure building blocks (masks, aggregation, hypernetwork, evidential losses, metrics) live in
``jaxfl.blocks`` and are re-exported here.
"""
from . import aggregation, blocks, evidential, hypernet, losses, masks, metrics, models, reliability
from .algorithms import ALGORITHMS, build_algorithm
from .blocks import *  # noqa: F401,F403  (the documented pure-function API)
from .engine import (Algorithm, ClientData, LocalTrainer, RoundInfo, init_state, make_evaluate, make_predict,
                     make_round, map_clients)
from .reliability import predict_proba, reliability_report
from .errors import ConfigError, DataError, JaxflError, NonFiniteError

__version__ = "0.1.0"
