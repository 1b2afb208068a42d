"""The vectorized engine: all clients stacked on a leading axis, one jitted function per round.

Pieces, each a pure function:
- ``ClientData`` (``jaxfl.data.clients``): padded per-client arrays ``x[N, M, ...]``, ``y[N, M]`` and real
  counts ``count[N]``.
- ``epoch_permutation``: a per-client shuffle, real samples first, drawn inside jit.
- ``LocalTrainer.run``: minibatch training of ONE client on its padded data; padded samples get weight 0.
- ``map_clients``: run a one-client function over the client axis by strategy ``vmap`` | ``map`` | ``chunked``.
- ``make_round`` / ``make_evaluate``: a whole round (cohort sampling, local updates, aggregation) and
  per-client evaluation, built from an ``Algorithm``.

Randomness: the key of client i in round t is ``fold_in(fold_in(fold_in(root, 0), t), i)``, so results do
not depend on the strategy, the chunk size, the cohort or the device layout.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from .aggregation import broadcast_clients
from .data.clients import ClientData
from .distributed import CLIENT_AXIS
from .errors import check_choice
from .losses import correct_count, cross_entropy

PyTree = Any
STRATEGIES = ("vmap", "map", "chunked")


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
                             f"(Simulation, make_round)")
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
    """
    name: str
    init: Callable
    local_update: Callable
    aggregate: Callable
    predict: Callable
    predict_trained: Callable | None = None
    prepare_predict: Callable | None = None


OPTIMIZERS = ("sgd", "adam")


def client_optimizer(name: str = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                     nesterov: bool = False) -> optax.GradientTransformation:
    """A client's optimizer as PyTorch builds it: ``sgd`` (momentum, nesterov) or ``adam``, with weight decay
    as an L2 term added to the gradient before the update (torch's ``weight_decay``, not AdamW):
    g <- g + weight_decay * w. Without weight decay it is exactly ``optax.sgd`` / ``optax.adam``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {OPTIMIZERS}")
    base = (optax.sgd(lr, momentum=momentum or None, nesterov=nesterov) if name == "sgd"
            else optax.adam(lr))
    return optax.chain(optax.add_decayed_weights(weight_decay), base) if weight_decay else base


def normalizer(mean: float = 0.5, std: float = 0.5) -> Callable:
    """uint8 images -> float32 (x / 255 - mean) / std; float inputs pass through unchanged."""
    def preprocess(x):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return (x.astype(jnp.float32) / 255.0 - mean) / std
        return x
    return preprocess


def epoch_permutation(key, count, m: int):
    """A random order of the M padded positions with the ``count`` real samples first.

    The priority of position j is uniform(fold_in(key, j)): it depends on j alone, so the order of the real
    samples is the same however much padding follows them.
    """
    idx = jnp.arange(m)
    prio = jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, j)))(idx)
    return jnp.argsort(jnp.where(idx < count, prio, 2.0))


@dataclasses.dataclass(frozen=True)
class LocalTrainer:
    """Minibatch optimisation of one client, as PyTorch's DataLoader(shuffle=True, drop_last=False) would.

    A client with n real samples takes ``ceil(n / batch_size)`` steps per epoch, its last batch partial: the
    step loop's trip count is the client's own (a ``while`` loop), so no step whose batch is all padding is
    computed. Under ``lax.map`` every client runs exactly its own steps; under ``vmap`` a group of clients
    runs until its longest client is done (the engine groups clients of similar size for that reason).
    The padded length M of ``data`` only bounds the step count (M / batch_size, rounded up).
    """
    tx: optax.GradientTransformation
    batch_size: int
    epochs: int
    preprocess: Callable = normalizer()
    lr: float | None = None  # tx's base lr, for updates that divide by it (SCAFFOLD, FedDC); the runner sets it

    def run(self, loss_fn, params, state, opt_state, data: ClientData, key):
        """Train one client.

        loss_fn(params, state, x, y, w, key) -> (loss, (new_state, logits)); w [B] is 1 for real samples.
        Returns (params, state, opt_state, metrics) with metrics {"loss", "accuracy", "seen", "steps"}: loss
        and accuracy are means over the real training samples seen this round, ``steps`` the optimizer steps.
        """
        b, m = self.batch_size, data.y.shape[0]
        slots = -(-m // b) * b  # the permutation padded to whole batches (indices past m are never real)
        n_steps = (data.count + b - 1) // b
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def epoch(e, carry):
            ekey = jax.random.fold_in(key, e)
            perm = epoch_permutation(jax.random.fold_in(ekey, 0), data.count, m)
            perm = jnp.pad(perm, (0, slots - m))

            def step(t, carry):
                params, state, opt_state, sums = carry
                start = t * b
                idx = jax.lax.dynamic_slice(perm, (start,), (b,))
                w = ((start + jnp.arange(b)) < data.count).astype(jnp.float32)
                x = self.preprocess(data.x[idx])
                (loss, (state, logits)), grads = grad_fn(params, state, x, data.y[idx], w,
                                                         jax.random.fold_in(ekey, t + 1))
                updates, opt_state = self.tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                n = jnp.sum(w)
                sums = sums + jnp.stack([loss * n, correct_count(logits, data.y[idx], w), n, 1.0])
                return params, state, opt_state, sums

            return jax.lax.fori_loop(0, n_steps, step, carry)

        init = (params, state, opt_state, jnp.zeros(4, jnp.float32))
        params, state, opt_state, sums = jax.lax.fori_loop(0, self.epochs, epoch, init)
        seen = jnp.maximum(sums[2], 1.0)
        return params, state, opt_state, {"loss": sums[0] / seen, "accuracy": sums[1] / seen,
                                          "seen": sums[2], "steps": sums[3]}


def map_clients(fn: Callable, strategy: str = "vmap", chunk_size: int = 8) -> Callable:
    """Apply a one-client function over the leading client axis of all its arguments.

    vmap: all clients at once; map: one after another (``lax.map``) inside the same jit; chunked: vmap
    over chunks of ``chunk_size`` clients, chunks one after another (bounded memory).
    """
    check_choice("client strategy", strategy, STRATEGIES)
    if strategy == "vmap":
        return jax.vmap(fn)
    batch = None if strategy == "map" else chunk_size
    return lambda *args: jax.lax.map(lambda a: fn(*a), args, batch_size=batch)


def over_clients(fn: Callable, strategy: str, chunk_size: int, mesh=None) -> Callable:
    """fn(shared, *stacked) -> stacked outputs, one client per row. Without a mesh: ``map_clients``; with
    one, every device applies ``map_clients`` to its own block of clients (``jax.shard_map``) and
    ``shared`` (e.g. the server state) is replicated. The number of clients must divide evenly."""
    def local(shared, *stacked):
        return map_clients(lambda *a: fn(shared, *a), strategy, chunk_size)(*stacked)
    if mesh is None:
        return local
    P = jax.sharding.PartitionSpec

    def sharded(shared, *stacked):
        n, d = jax.tree_util.tree_leaves(stacked)[0].shape[0], mesh.devices.size
        if n % d:
            raise ValueError(f"{n} clients per round cannot be split evenly over {d} devices; "
                             f"choose a cohort size that is a multiple of {d}")
        in_specs = (P(),) + (P(CLIENT_AXIS),) * len(stacked)
        # check_vma=False: scans inside local updates carry per-client values that start from replicated ones
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(CLIENT_AXIS),
                             check_vma=False)(shared, *stacked)
    return sharded


def client_keys(root, round_idx, client_ids):
    """Key of client i in round t: fold_in(fold_in(fold_in(root, 0), t), i)."""
    rkey = jax.random.fold_in(jax.random.fold_in(root, 0), round_idx)
    return jax.vmap(lambda i: jax.random.fold_in(rkey, i))(client_ids)


def sample_cohort(root, round_idx, num_clients: int, cohort_size: int):
    """Sorted ids of ``cohort_size`` = k clients drawn uniformly without replacement from N (everyone if k >= N).

    Floyd's algorithm, O(k^2) work and O(k) memory whatever N (a permutation of all N ids would cost O(N log N)
    per round: 84 ms at N = 100,000 on CPU): for t = 0..k-1, with j = N - k + t and
    r_t = randint(fold_in(key, t), 0, j + 1), add r_t to the cohort unless it is already there, else add j.
    Every k-subset is equally likely. key = fold_in(fold_in(root, 1), round).
    """
    if cohort_size >= num_clients:
        return jnp.arange(num_clients)
    key = jax.random.fold_in(jax.random.fold_in(root, 1), round_idx)
    return _floyd_draw(key, int(num_clients), int(cohort_size))


@functools.partial(jax.jit, static_argnums=(1, 2))  # jitted: the host-side Simulation calls it every round
def _floyd_draw(key, n: int, k: int):
    def draw(t, chosen):
        j = n - k + t
        r = jax.random.randint(jax.random.fold_in(key, t), (), 0, j + 1)
        return chosen.at[t].set(jnp.where(jnp.any(chosen == r), j, r))

    return jnp.sort(jax.lax.fori_loop(0, k, draw, jnp.full((k,), -1, jnp.int32)))


def tree_all_finite(tree):
    """True iff every floating entry of the pytree is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def init_state(alg: Algorithm, key, sample_x, num_clients: int):
    """(server_state, clients): every client starts from the same initial state."""
    server, client = alg.init(key, sample_x)
    return server, jax.tree_util.tree_map(jnp.array, broadcast_clients(client, num_clients))


def make_cohort_update(alg: Algorithm, *, strategy="vmap", chunk_size=8, mesh=None,
                       num_rounds: int | None = None) -> Callable:
    """Build update(server, clients, data, ids, round_idx, root) -> (new_clients, metrics), one row per client.

    clients: the persistent states of k clients stacked [k]; data: their ClientData [k, M]; ids [k]: their
    client ids (their PRNG streams, ``client_keys``, and ``RoundInfo.client_id``). metrics per client:
    ``loss``, ``accuracy``, ``seen``, ``steps`` (and what the algorithm adds) and ``finite`` (loss and new
    state all finite). num_rounds: T, for ``RoundInfo`` (algorithms with schedules need it).
    """
    def one(shared, client, x, y, count, key, cid):
        server, round_idx = shared
        info = RoundInfo(round_idx, cid, num_rounds)
        new, metrics = alg.local_update(server, client, ClientData(x, y, count), key, info)
        return new, dict(metrics, finite=tree_all_finite(new) & jnp.isfinite(metrics["loss"]))

    def update(server, clients, data: ClientData, ids, round_idx, root):
        ids = jnp.asarray(ids, jnp.int32)
        keys = client_keys(root, round_idx, ids)
        return over_clients(one, strategy, chunk_size, mesh)((server, jnp.asarray(round_idx, jnp.int32)), clients,
                                                             data.x, data.y, data.count, keys, ids)

    return update


def aggregation_weights(counts, weighting: str):
    """Client weights for aggregation: their sample counts (``samples``) or 1 each (``uniform``)."""
    counts = jnp.asarray(counts).astype(jnp.float32)
    return counts if weighting == "samples" else jnp.ones_like(counts)


def make_round(alg: Algorithm, *, strategy="vmap", chunk_size=8, cohort_size=None,
               weighting="samples", mesh=None, num_rounds: int | None = None) -> Callable:
    """Build round(server, clients, data, round_idx, root) -> (server, clients, metrics), all in one jit.

    The simple layout: ``clients`` is every client's persistent state stacked [N] and ``data`` every client's
    samples padded to the largest ([N, M]); the cohort is gathered inside. ``jaxfl.simulation.Simulation``
    runs the same round over ragged data and a per-client store, at a cost that follows the real samples.
    metrics: per cohort client ``loss``, ``accuracy``, ``seen``, ``steps``, ``finite`` and ``client_id``.
    Aggregation weights: sample counts (``samples``) or equal (``uniform``). ``mesh`` (see ``client_mesh``)
    splits the cohort over devices; the aggregation's reductions over clients then become all-reduces.
    num_rounds: T, passed to the algorithm in its ``RoundInfo``.
    """
    check_choice("weighting", weighting, ("samples", "uniform"))
    update = make_cohort_update(alg, strategy=strategy, chunk_size=chunk_size, mesh=mesh, num_rounds=num_rounds)

    def round_fn(server, clients, data: ClientData, round_idx, root):
        n = data.num_clients
        ids = sample_cohort(root, round_idx, n, cohort_size or n)
        full = (cohort_size or n) >= n
        c_clients = clients if full else jax.tree_util.tree_map(lambda a: a[ids], clients)
        c_data = data if full else data.take(ids)
        new_c, metrics = update(server, c_clients, c_data, ids, round_idx, root)
        info = RoundInfo(jnp.asarray(round_idx, jnp.int32), ids.astype(jnp.int32), num_rounds)
        server, new_c = alg.aggregate(server, new_c, aggregation_weights(c_data.count, weighting), info)
        clients = new_c if full else jax.tree_util.tree_map(lambda a, b: a.at[ids].set(b), clients, new_c)
        return server, clients, dict(metrics, client_id=ids)

    return round_fn


def split_output(out):
    """(logits, diagnostics) from ``Algorithm.predict``'s output, which may be logits alone."""
    return out if isinstance(out, tuple) else (out, {})


def make_predict(alg: Algorithm, *, eval_batch_size=256, strategy="vmap", chunk_size=8,
                 preprocess: Callable = normalizer(), transform: Callable | None = None, mesh=None) -> Callable:
    """Build predict_all(server, clients, data, key=None, ids=None, train=None) -> (logits [N, M, K],
    {name: [N, M]}).

    Every client predicts its own padded inputs in evaluation mode, in batches of ``eval_batch_size``
    (``lax.map``; M must be a multiple of it); rows past ``data.count`` are padding (mask them with
    ``data.sample_mask()``). ids [N]: the rows' client ids (default 0..N-1). ``transform(x, key)`` changes
    each preprocessed batch (e.g. input noise); batch j of client i gets ``fold_in(fold_in(key, i), j)``.
    train: the clients' training sets (a ClientData, raw inputs), needed by an algorithm with
    ``prepare_predict``, which turns (server, client, its preprocessed training set, fold_in(key, i)) into the
    ``client`` its ``predict`` sees.
    """
    def one(shared, client, x, cid, train=None):
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

        xs = x.reshape((nb, eval_batch_size) + x.shape[1:])
        out = jax.lax.map(batch, (xs, jnp.arange(nb)))
        return jax.tree_util.tree_map(lambda a: a.reshape((nb * eval_batch_size,) + a.shape[2:]), out)

    def predict_all(server, clients, data: ClientData, key=None, ids=None, train: ClientData | None = None):
        key = jax.random.key(0) if key is None else key
        ids = jnp.arange(data.num_clients, dtype=jnp.int32) if ids is None else jnp.asarray(ids, jnp.int32)
        if alg.prepare_predict is not None:
            if train is None:
                raise ValueError(f"{alg.name} predicts from each client's training set: pass train=")
            return over_clients(one, strategy, chunk_size, mesh)((server, key), clients, data.x, ids, train)
        return over_clients(one, strategy, chunk_size, mesh)((server, key), clients, data.x, ids)

    return predict_all


def make_evaluate(alg: Algorithm, *, eval_batch_size=256, strategy="vmap", chunk_size=8,
                  preprocess: Callable = normalizer(), mesh=None) -> Callable:
    """Build evaluate(server, clients, data, ids=None, train=None) -> {"loss", "accuracy", "count", ...} per
    client [N].

    ids [N]: the rows' client ids (default 0..N-1). Means over each client's real test samples (padding counts
    nowhere) of CE and accuracy; if ``alg.predict`` returns (logits, {name: [B]}), each diagnostic is averaged
    the same way under its name. train: the clients' training sets, for an algorithm with ``prepare_predict``.
    """
    predict_all = make_predict(alg, eval_batch_size=eval_batch_size, strategy=strategy, chunk_size=chunk_size,
                               preprocess=preprocess, mesh=mesh)

    def evaluate(server, clients, data: ClientData, ids=None, train: ClientData | None = None):
        logits, extra = predict_all(server, clients, data, ids=ids, train=train)
        w = data.sample_mask()
        n = jnp.maximum(data.count.astype(jnp.float32), 1.0)
        sums = {"loss": jnp.sum(w * cross_entropy(logits, data.y), -1),
                "accuracy": jax.vmap(correct_count)(logits, data.y, w)}
        sums.update({k: jnp.sum(w * v, -1) for k, v in extra.items()})
        return dict({k: v / n for k, v in sums.items()}, count=data.count)

    return evaluate
