"""Evaluation: every client's model on its own test set, in evaluation mode.

- ``make_predict`` / ``make_evaluate``: pure functions over stacked clients (per-sample outputs; per-client
  means of CE, accuracy and the algorithm's diagnostics over the real samples).
- ``Evaluator``: the one evaluation of a run. It walks the population (or the clients asked for) in blocks,
  gathers each block's ragged test sets padded to the block's largest (rounded to the step grid, so few
  shapes compile) and runs the jitted functions above: ``metrics`` (after the round, or of the models right
  after local training: ``predict="trained"``; optionally after a local update the caller gives, ``tune``)
  and ``predictions`` (per-sample outputs, for reliability reports).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..data.clients import ClientData
from ..data.ragged import RaggedClients
from ..errors import ConfigError, check_choice
from .buckets import grid_ceil
from .cohort import ClientMap, client_map
from .distributed import fetch
from .metrics import correct_count, cross_entropy
from .trainer import draws_random, normalizer
from .types import Algorithm, split_output


PREDICTS = ("aggregated", "trained")  # the model after the round, or right after local training


def make_predict(alg: Algorithm, *, eval_batch_size=256, clients: ClientMap | str | None = None,
                 preprocess: Callable = normalizer(), transform: Callable | None = None,
                 tail_sizes: tuple[int, ...] = ()) -> Callable:
    """Build predict_all(server, clients, data, key=None, ids=None, train=None) -> (logits [N, M, K],
    {name: [N, M]}).

    Every client predicts its own inputs in evaluation mode, in batches of ``eval_batch_size`` (M must be a
    multiple of it), running only the ceil(count / B) batches that hold real samples (under ``vmap``: its
    group's largest), the clients run by ``clients`` (a ``ClientMap`` or its name: ``cohort.client_map``; split
    over its mesh if it has one); rows
    past ``data.count`` are padding, zero where no batch ran (mask them with ``data.sample_mask()``). ids [N]:
    the rows' client ids (default 0..N-1). ``transform(x, key)`` changes each preprocessed batch (e.g. input
    noise); batch j of client i gets ``fold_in(fold_in(key, i), j)``.
    tail_sizes: batch sizes ascending, B last (``trainer.tail_sizes``): a client's partial last batch of r real
    samples runs at the smallest one >= r instead of B (the same outputs up to float rounding: a prediction
    depends on its own input only). Meant for ``map``, where the ``lax.switch`` runs one branch (under ``vmap``
    it runs them all); ignored where a batch's prediction or ``transform`` draws random numbers (their draws
    take the batch's shape: FedSR's sampled representation, input noise), which keep every batch at B.
    train: the clients' training sets (a ClientData, raw inputs), needed by an algorithm with
    ``prepare_predict``, which turns (server, client, its preprocessed training set, fold_in(key, i)) into the
    ``client`` its ``predict`` sees.
    """
    clients_map = client_map(clients)  # (predict_all's ``clients`` are the states)
    sizes = tuple(tail_sizes)
    if sizes and (sizes[-1] != eval_batch_size or list(sizes) != sorted(set(sizes))):
        raise ValueError(f"tail_sizes {sizes} must ascend and end with eval_batch_size {eval_batch_size}")

    def one(shared, client, x, count, cid, train=None):
        server, key = shared
        if alg.prepare_predict is not None:
            train = ClientData(preprocess(train.x), train.y, train.count)
            client = alg.prepare_predict(server, client, train, jax.random.fold_in(key, cid))
        nb = x.shape[0] // eval_batch_size

        def batch(args):
            xb, j = args
            xb = preprocess(xb)
            if transform is not None:
                xb = transform(xb, jax.random.fold_in(jax.random.fold_in(key, cid), j))
            return split_output(alg.predict(server, client, xb, cid))

        if len(sizes) > 1 and not draws_random(batch, (x[:eval_batch_size], jnp.int32(0))):
            return with_tails(batch, x, count, nb)
        xs = x.reshape((nb, eval_batch_size) + x.shape[1:])
        # only the client's own batches run (ceil(count / B) of them; under vmap, the group's largest): the
        # outputs of batches past them stay zero, padding that every consumer masks with the sample count
        shapes = jax.eval_shape(batch, (xs[0], jnp.int32(0)))
        out = jax.tree_util.tree_map(lambda sd: jnp.zeros((nb,) + sd.shape, sd.dtype), shapes)
        own = (count + eval_batch_size - 1) // eval_batch_size

        def step(j, out):
            return jax.tree_util.tree_map(lambda a, v: a.at[j].set(v), out, batch((xs[j], j)))
        out = jax.lax.fori_loop(0, jnp.minimum(own, nb), step, out)
        return jax.tree_util.tree_map(lambda a: a.reshape((nb * eval_batch_size,) + a.shape[2:]), out)

    def with_tails(batch, x, count, nb):
        """The client's full batches at B, then its partial last one (if any) at the smallest of ``sizes``
        that holds it, each written at its offset into the padded outputs [nb B, ...]."""
        b = eval_batch_size
        shapes = jax.eval_shape(batch, (x[:b], jnp.int32(0)))
        out = jax.tree_util.tree_map(lambda sd: jnp.zeros((nb * b,) + sd.shape[1:], sd.dtype), shapes)

        def run_at(size, j, out):  # batch j (rows j B .. j B + size) written in place
            v = batch((jax.lax.dynamic_slice_in_dim(x, j * b, size), j))
            return jax.tree_util.tree_map(lambda a, u: jax.lax.dynamic_update_slice_in_dim(a, u, j * b, 0), out, v)
        if nb == 1:  # one batch: all of it through the switch (a loop over a one-batch array would have its body
            # hoisted out by XLA, as its slice does not depend on the index, and run at B even for zero trips)
            full = jnp.int32(0)
        else:
            full = jnp.minimum(count // b, nb)
            out = jax.lax.fori_loop(0, full, lambda j, out: run_at(b, j, out), out)
        rest = jnp.where(full < nb, count - full * b, 0)  # the last batch's real samples (0: none)
        which = jnp.where(rest > 0, 1 + jnp.searchsorted(jnp.asarray(sizes, jnp.int32), rest.astype(jnp.int32),
                                                    method="compare_all"), 0)  # (a few sizes: no loop)
        branches = [lambda out: out] + [lambda out, s=s: run_at(s, full, out) for s in sizes]
        return jax.lax.switch(which, branches, out)

    def predict_all(server, clients, data: ClientData, key=None, ids=None, train: ClientData | None = None):
        key = jax.random.key(0) if key is None else key
        ids = jnp.arange(data.num_clients, dtype=jnp.int32) if ids is None else jnp.asarray(ids, jnp.int32)
        if alg.prepare_predict is not None:
            if train is None:
                raise ValueError(f"{alg.name} predicts from each client's training set: pass train=")
            return clients_map.over(one)((server, key), clients, data.x, data.count, ids, train)
        return clients_map.over(one)((server, key), clients, data.x, data.count, ids)

    return predict_all


def make_evaluate(alg: Algorithm, *, eval_batch_size=256, clients: ClientMap | str | None = None,
                  preprocess: Callable = normalizer(), tail_sizes: tuple[int, ...] = ()) -> Callable:
    """Build evaluate(server, clients, data, ids=None, train=None) -> {"loss", "accuracy", "count", ...} per
    client [N].

    ids [N]: the rows' client ids (default 0..N-1). Means over each client's real test samples (padding counts
    nowhere) of CE and accuracy, NaN for a client without test samples (a mean over none); if ``alg.predict``
    returns (logits, {name: [B]}), each diagnostic is averaged the same way under its name. train: the clients'
    training sets, for an algorithm with ``prepare_predict``. tail_sizes: as ``make_predict``'s.
    """
    predict_all = make_predict(alg, eval_batch_size=eval_batch_size, clients=clients, preprocess=preprocess,
                               tail_sizes=tail_sizes)

    def evaluate(server, clients, data: ClientData, ids=None, train: ClientData | None = None):
        logits, extra = predict_all(server, clients, data, ids=ids, train=train)
        w = data.sample_mask()
        n = data.count.astype(jnp.float32)
        sums = {"loss": jnp.sum(w * cross_entropy(logits, data.y), -1),
                "accuracy": jax.vmap(correct_count)(logits, data.y, w)}
        sums.update({k: jnp.sum(w * v, -1) for k, v in extra.items()})
        mean = lambda v: jnp.where(n > 0, v / jnp.maximum(n, 1.0), jnp.nan)  # noqa: E731
        return dict({k: mean(v) for k, v in sums.items()}, count=data.count)

    return evaluate


def stacked_rows(states, ids):
    """Rows ``ids`` of the clients' states: a ``ClientStore`` (``gather``) or a pytree stacked [N]."""
    if hasattr(states, "gather"):
        return states.gather(ids)
    return jax.tree_util.tree_map(lambda a: np.asarray(a)[ids] if isinstance(a, np.ndarray) else a[ids], states)


class Evaluator:
    """Every client of a population evaluated on its own (ragged) test set, ``block`` clients per call.

    A block (a multiple of the device count) is padded to its largest test set rounded up to the step grid of
    ``eval_batch_size``. train: the clients' training sets, gathered the same way, for an algorithm that
    predicts from them (``Algorithm.prepare_predict``) or for a local update before evaluating (``tune``).
    first_id: the client id of row 0 (row i predicts as client ``first_id + i``: clients held out of training
    have ids past the training population's). tail_sizes: each client's partial last batch at the smallest of
    these sizes that holds it (``make_predict``; for ``map``).
    """

    def __init__(self, alg: Algorithm, test: RaggedClients, *, eval_batch_size: int, preprocess: Callable,
                 clients: ClientMap | str | None = None, block: int = 64,
                 train: RaggedClients | None = None, first_id: int = 0, tail_sizes: tuple[int, ...] = ()):
        if alg.prepare_predict is not None and train is None:
            raise ValueError(f"{alg.name} predicts from each client's training set: pass train=")
        if not isinstance(eval_batch_size, int) or eval_batch_size < 1:
            raise ConfigError(f"eval_batch_size={eval_batch_size!r} must be an integer >= 1")
        self.alg, self.test, self.train, self.first_id = alg, test, train, first_id
        self.clients = client_map(clients)
        self.eval_batch_size = eval_batch_size
        devices = self.clients.devices
        self.block = max(devices, -(-min(block, test.num_clients) // devices) * devices)
        self.tail_sizes = tuple(tail_sizes)
        self._kw: dict[str, Any] = dict(eval_batch_size=eval_batch_size, clients=self.clients, preprocess=preprocess,
                                        tail_sizes=self.tail_sizes)
        self._fns: dict[Any, Callable] = {}

    def _fn(self, kind: str, predict: str, transform=None):
        key = (kind, predict, transform)
        check_choice("predict", predict, PREDICTS)
        if key not in self._fns:
            alg = self.alg
            if predict == "trained":
                if alg.predict_trained is None:
                    raise ValueError(f"{alg.name} has no prediction of a just-trained model")
                alg = alg._replace(predict=alg.predict_trained)
            make = make_evaluate if kind == "metrics" else make_predict
            extra = {} if transform is None else {"transform": transform}
            self._fns[key] = jax.jit(make(alg, **self._kw, **extra))
        return self._fns[key]

    def _blocks(self, inputs_shift: int = 0, rows=None, with_train: bool = False):
        """(ids, real, data, train): each block's rows (padded past the last with row 0), which are real, the
        block's test sets (of row (i + inputs_shift) mod N for row i) and training sets (for
        ``prepare_predict`` or ``with_train``), as host arrays. rows: the rows to evaluate (default all N)."""
        test, n, bs = self.test, self.test.num_clients, self.eval_batch_size
        rows = np.arange(n) if rows is None else np.asarray(rows, np.int64)
        for start in range(0, len(rows), self.block):
            which = rows[start:start + self.block]
            real = np.arange(self.block) < len(which)
            ids = np.where(real, np.pad(which, (0, self.block - len(which))), 0)
            src = np.where(real, (ids + inputs_shift) % n, -1)

            def gather(ragged, which):  # padded to the block's largest, rounded to the step grid
                length = bs * grid_ceil(-(-int(ragged.counts[which[which >= 0]].max()) // bs))
                return ragged.gather(which, length)
            needs_train = with_train or self.alg.prepare_predict is not None
            train = gather(self.train, np.where(real, ids, -1)) if needs_train else None
            yield ids, real, gather(test, src), train

    def _run(self, fn, server, states, inputs_shift: int = 0, rows=None, tune: Callable | None = None, **kw):
        for ids, real, data, train in self._blocks(inputs_shift, rows, with_train=tune is not None):
            block_ids = self.clients.place((ids + self.first_id).astype(np.int32))
            block_states = self.clients.place(stacked_rows(states, ids))
            if tune is not None:  # every row's local update first (on its training set), then the evaluation
                block_states = tune(server, block_states, self.clients.place(train), block_ids)
            extra = {} if self.alg.prepare_predict is None else {"train": self.clients.place(train)}
            out = fn(server, block_states, self.clients.place(data), ids=block_ids, **kw, **extra)
            yield real, data, fetch(out)

    def metrics(self, server, states, predict: str = "aggregated", rows=None,
                tune: Callable | None = None) -> dict[str, np.ndarray]:
        """{"loss", "accuracy", "count", diagnostics...} per evaluated row (numpy; all N rows unless ``rows``, the
        rows to evaluate, in that order). states: a ``ClientStore``, every client's state stacked [N], or an
        object whose ``gather(ids)`` gives the rows' states; predict: ``aggregated`` (``Algorithm.predict``) or
        ``trained`` (``predict_trained``: ``states`` are the rows ``local_update`` returned).
        tune(server, states, train, ids) -> states: a local update of a block's rows on their training sets
        (``ClientData``; ids: their client ids), run before the evaluation (then ``predict="trained"``)."""
        parts = [{k: np.asarray(v)[real] for k, v in m.items()}
                 for real, _, m in self._run(self._fn("metrics", predict), server, states, rows=rows, tune=tune)]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def predictions(self, server, states, key=None, transform: Callable | None = None,
                    inputs_shift: int = 0) -> list[tuple[np.ndarray, dict, np.ndarray]]:
        """Per client, (outputs [n_i, K], diagnostics {name: [n_i]}, labels [n_i]) of its real test samples.
        transform(x, key) changes each preprocessed batch (``make_predict``); inputs_shift: client i predicts
        the test inputs of client (i + inputs_shift) mod N (labels are theirs too), with its own model."""
        out = []
        fn = self._fn("predict", "aggregated", transform)
        for real, data, (logits, extra) in self._run(fn, server, states, inputs_shift, key=key):
            for j in np.flatnonzero(real):
                n = int(data.count[j])
                out.append((np.asarray(logits[j, :n]), {k: np.asarray(v[j, :n]) for k, v in extra.items()},
                            np.asarray(data.y[j, :n])))
        return out
