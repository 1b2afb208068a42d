"""The engine: the algorithm contract, local training, the cohort step, the data backends, evaluation,
aggregation reductions, bucket planning, pytree helpers and the device mesh. Depends on ``jaxfl.data`` and
``jaxfl.errors`` only."""
from .backends import ClientStore, Ragged, Stacked, Streamed
from .cohort import Chunked, ClientMap, Map, Vmap, client_map
from .evaluate import Evaluator, make_evaluate, make_predict
from .step import Step, init_state, make_step
from .trainer import ClientOptimizer, LocalTrainer, client_optimizer, normalizer
from .types import Algorithm, RoundInfo, RunContext


__all__ = ["Algorithm", "Chunked", "ClientMap", "ClientOptimizer", "ClientStore", "Evaluator", "LocalTrainer",
           "Map", "Ragged", "RoundInfo", "RunContext", "Stacked", "Streamed", "Step", "Vmap", "client_map",
           "client_optimizer", "init_state", "make_evaluate", "make_predict", "make_step", "normalizer"]
