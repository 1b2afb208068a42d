"""A run's evaluation protocols (``--eval-model``, ``--eval-clients``, ``--new-clients``) around
``core.evaluate.Evaluator``.

- Which model (``eval_model``): ``personal``, each client's own state (what the method gives the client);
  ``global``, the server's own model (``server_predict``: its ``params`` and BatchNorm statistics applied as
  the model, whatever the client holds; for a method that keeps part of the model per client, the server's
  copy of that part, e.g. FedPer's initial head); ``both``, the personal model in the plain fields and the
  global one in ``global_`` fields. A method whose server holds no whole model (``holds_model``: pFedHN's
  hypernetwork, FedProto's prototypes) has no global model here.
- Which clients (``eval_clients``): ``all``, or ``cohort``, the clients that trained in the evaluated round
  (the others are null in the per-client lists and left out of the means, as a client without test samples).
- New clients (``new_clients`` = K): K clients of the population, a uniform K-subset drawn from the seed
  (``held_out``), never train. The run's training population is the other N - K clients, ids 0..N-K-1 in
  their order; the held-out clients get ids N-K..N-1 in theirs. At every evaluation they are evaluated with
  the global model where the server holds one (``new_`` fields) and, for an algorithm that predicts with a
  model just trained (``Algorithm.predict_trained``), after one local update of the method itself (without the
  run's server-side or DP-FedAvg wrappers: nothing is sent) from the server's state and the initial client
  state, on their training split (``new_tuned_`` fields: the method's own personalization step, its local
  epochs, or at most ``new_client_steps`` local steps, ``LocalTrainer.max_steps``; client j's key is
  ``client_keys(fold_in(key(seed), TUNE_STREAM), round, id_j)``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..core.aggregation import broadcast_clients
from ..core.cohort import sample_cohort
from ..data.federated import FederatedDataset

EVAL_MODELS = ("personal", "global", "both")
EVAL_CLIENTS = ("all", "cohort")
NEW_CLIENTS_STREAM, TUNE_STREAM = 9, 10  # fold_in(key(seed), ·): the held-out draw, their local updates' keys


def held_out(seed: int, num_clients: int, count: int) -> np.ndarray:
    """The ``count`` client indices of ``num_clients`` held out of training, sorted: a uniform subset drawn from
    fold_in(key(seed), NEW_CLIENTS_STREAM) (``cohort.sample_cohort``'s draw). int [count]."""
    if count == 0:
        return np.zeros(0, np.int64)
    key = jax.random.fold_in(jax.random.key(seed), NEW_CLIENTS_STREAM)
    return np.asarray(sample_cohort(key, 0, num_clients, count), np.int64)


def split_clients(ds: FederatedDataset, held: np.ndarray) -> tuple[FederatedDataset, FederatedDataset]:
    """(training clients, held-out clients) of ``ds``: the clients not in ``held`` and those in it, each in
    their order (names, training and test splits)."""
    out = np.isin(np.arange(len(ds.client_names)), held)
    pick = lambda mask: dataclasses.replace(  # noqa: E731
        ds, client_names=[c for c, m in zip(ds.client_names, mask) if m],
        train=[t for t, m in zip(ds.train, mask) if m], test=[t for t, m in zip(ds.test, mask) if m])
    return pick(~out), pick(out)


@dataclasses.dataclass(frozen=True)
class InitialStates:
    """Every client's state as the initial one (one client's state, ``Algorithm.init``'s): ``gather(ids)``
    stacks it for the rows ``ids`` (the global model's evaluation: no client state is ever materialized for
    the whole population)."""
    client: object

    def gather(self, ids):
        return jax.tree_util.tree_map(jnp.array, broadcast_clients(self.client, len(ids)))


def server_variables(server) -> dict:
    """The model variables a server state holds: its ``params`` and ``batch_stats`` ({} if none)."""
    return {"params": server["params"], "batch_stats": server.get("batch_stats", {})}


def holds_model(server_shapes, model, sample_x) -> bool:
    """Whether a server state (its shapes: ``jax.eval_shape`` of ``Algorithm.init``'s server) holds a whole
    ``model``: ``params`` and ``batch_stats`` of exactly the model's tree structure and shapes."""
    if not isinstance(server_shapes, dict) or "params" not in server_shapes:
        return False
    want = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), sample_x)
    want = {"params": want["params"], "batch_stats": want.get("batch_stats", {})}
    have = server_variables(server_shapes)
    shapes = lambda tree: jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    try:
        return shapes(have) == shapes(want)
    except (TypeError, ValueError):
        return False


def server_predict(model):
    """predict(server, client, x, client_id) with the server's own model (``server_variables``) in evaluation
    mode; the client's state is not read."""
    def predict(server, client, x, client_id=None):
        return model.apply(server_variables(server), x, train=False)
    return predict


def on_rows(metrics: dict, rows: np.ndarray, num_clients: int) -> dict:
    """Per-client metrics of the evaluated ``rows`` spread over all ``num_clients`` rows: NaN (count 0) for a
    row not evaluated, which ``runner.eval_record`` lists as null and leaves out of the means."""
    full = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        out = np.zeros(num_clients, v.dtype) if k == "count" else np.full(num_clients, np.nan)
        out[rows] = v
        full[k] = out
    return full


def prefixed(record: dict, prefix: str) -> dict:
    """``eval_record``'s fields renamed for another model or other clients: test_accuracy -> <prefix>test_accuracy,
    mean_accuracy -> <prefix>mean_accuracy, ..."""
    return {prefix + k: v for k, v in record.items()}
