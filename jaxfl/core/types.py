"""The contract between an algorithm and the engine: ``Algorithm``, ``RoundInfo`` and ``RunContext``."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import flax.struct
import jax


PyTree = Any


@flax.struct.dataclass
class RoundInfo:
    """Where the engine is, passed to an algorithm's ``local_update`` and ``aggregate``.

    round: int32 [], the 0-based index of this round.
    client_id: int32 [] for one client (``local_update``), [k] for the cohort (``aggregate``: the ids of the
        trained rows, in their order).
    num_rounds: the run's total number of rounds T (static), or None when the caller did not say.
    """
    round: jax.Array
    client_id: jax.Array
    num_rounds: int | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def is_last(self) -> jax.Array:
        """True in the run's last round (round == T - 1); needs ``num_rounds``."""
        return self.round >= self.total_rounds("is_last") - 1

    def total_rounds(self, what: str = "this algorithm") -> int:
        """T, or a ValueError naming ``what`` needs it when the caller gave no ``num_rounds``."""
        if self.num_rounds is None:
            raise ValueError(f"{what} needs the run's number of rounds: pass num_rounds= to the engine "
                             f"(the backends, make_step)")
        return self.num_rounds


class Algorithm(NamedTuple):
    """A federated algorithm as four pure functions (the engine does the rest).

    init(key, sample_x) -> (server_state, client_state)    client_state: the persistent state of ONE client,
                                                           only what the method keeps between rounds (FedAvg:
                                                           {}); every client starts from the same one
    local_update(server, client, data, key, info) -> (trained, metrics)  ONE client; data is a ClientData
                                                           row, info its ``RoundInfo``
    aggregate(server, trained, weights, info) -> (server, clients)  trained stacked over the cohort (info's
                                                           client_id [k]); returns the cohort's new persistent
                                                           states (init's structure)
    predict(server, client, x, client_id) -> logits        evaluation-mode prediction of ONE client
    predict_trained(server, trained, x, client_id) -> logits   optional: the prediction of a client's model
                                                           right after its local training (``trained``: the
                                                           row local_update returned), for evaluating before
                                                           aggregation (``eval_point="local"``)
    prepare_predict(server, client, train, key) -> client     optional: what ``predict`` gets as ``client``,
                                                           computed once per evaluation from the client's
                                                           training set ``train`` (a ClientData row): a method
                                                           that predicts from its data (pFedGP's GPs)
    share_mask(server, info) -> mask                        optional: which leaves of server["params"] the
                                                           aggregate averages this round (a tree of Python
                                                           bools or bool scalars; None: all of them), for
                                                           clipping and noising the shared update
                                                           (``jaxfl.core.privacy``)
    round_metrics(before, after) -> {name: scalar}          optional: per-round scalars read off the server
                                                           state entering (``before``) and leaving (``after``)
                                                           the round, logged once a round (adaptive clipping's
                                                           norm)
    aggregates_empty: whether ``aggregate`` also defines the round of a cohort without a client of positive
    weight (Poisson sampling can draw one; DP-FedAvg still adds its noise); False: the engine keeps the server
    state as it was
    """
    name: str
    init: Callable
    local_update: Callable
    aggregate: Callable
    predict: Callable
    predict_trained: Callable | None = None
    prepare_predict: Callable | None = None
    share_mask: Callable | None = None
    round_metrics: Callable | None = None
    aggregates_empty: bool = False


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What an algorithm's factory may need to know about the run besides its options (``None``: unknown).

    num_clients: N, the population (the size of a per-client table on the server: FedTP, pFedHN; the 1/N of
    a server update over all clients: SCAFFOLD, FedDyn, FedDC); num_rounds: T; dataset: its name (presets);
    cohort_size: the clients trained per round (a client's expected participations over the run,
    cohort_size / num_clients * num_rounds: FedPHP). The client optimizer's settings (learning rate, momentum)
    are the trainer's: ``LocalTrainer.optimizer``.
    """
    num_clients: int | None = None
    num_rounds: int | None = None
    dataset: str | None = None
    cohort_size: int | None = None


def split_output(out):
    """(logits, diagnostics) from ``Algorithm.predict``'s output, which may be logits alone."""
    return out if isinstance(out, tuple) else (out, {})
