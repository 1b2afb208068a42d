"""jaxfl: vectorized personalized federated learning in JAX."""
from . import aggregation, losses, models
from .aggregation import masked_mean, tree_masked_mean, tree_weighted_mean, weighted_mean
from .algorithms import ALGORITHMS, build_algorithm
from .engine import (Algorithm, ClientData, LocalTrainer, make_evaluate, make_round, map_clients,
                     init_state)
from .errors import ConfigError, DataError, JaxflError, NonFiniteError

__version__ = "0.1.0"
