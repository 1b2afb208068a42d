"""Local training of one client: the client optimizer, input normalisation, the epoch shuffle and the
minibatch loop (``LocalTrainer``)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import optax

from ..data.clients import ClientData
from .cohort import position_uniforms
from .dpsgd import SELECT_STREAM, SampleDP, poisson_members, poisson_rate, private_gradient
from .metrics import correct_count


OPTIMIZERS = ("sgd", "adam")


@dataclasses.dataclass(frozen=True)
class ClientOptimizer:
    """A client's optimizer settings, as PyTorch builds it: ``sgd`` (momentum, nesterov) or ``adam``, with
    weight decay as an L2 term added to the gradient before the update (torch's ``weight_decay``, not AdamW):
    g <- g + weight_decay * w. ``transform()`` is exactly ``optax.sgd`` / ``optax.adam`` without weight decay.

    The one place an algorithm reads the client learning rate and momentum from (``LocalTrainer.optimizer``):
    SCAFFOLD's and FedDC's control variates divide by lr, FedNova's normalizing vector follows the momentum.
    """
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not one of {OPTIMIZERS}")

    def transform(self) -> optax.GradientTransformation:
        """The optax transformation of these settings."""
        base = (optax.sgd(self.lr, momentum=self.momentum or None, nesterov=self.nesterov) if self.name == "sgd"
                else optax.adam(self.lr))
        return optax.chain(optax.add_decayed_weights(self.weight_decay), base) if self.weight_decay else base

    @property
    def sgd_momentum(self) -> float:
        """SGD's momentum coefficient rho (0 for Adam, whose steps have no such linear recursion)."""
        return float(self.momentum) if self.name == "sgd" else 0.0


def client_optimizer(name: str = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                     nesterov: bool = False) -> optax.GradientTransformation:
    """``ClientOptimizer(...).transform()``: the optax transformation alone."""
    return ClientOptimizer(name, lr, momentum, weight_decay, nesterov).transform()


def normalizer(mean: float | tuple[float, ...] = 0.5, std: float | tuple[float, ...] = 0.5) -> Callable:
    """uint8 images -> float32 (x / 255 - mean) / std; other inputs (floats, token ids) pass through unchanged.
    ``mean``, ``std``: scalars, or one value per channel (the images' last axis)."""
    per_channel = not isinstance(mean, (int, float)) or not isinstance(std, (int, float))
    m, s = (np.asarray(mean, np.float32), np.asarray(std, np.float32)) if per_channel else (mean, std)

    def preprocess(x):
        if x.dtype == jnp.uint8:
            return (x.astype(jnp.float32) / 255.0 - m) / s
        return x
    return preprocess


def epoch_permutation(key, count, m: int, bound=None):
    """A random order of the M padded positions with the ``count`` real samples first.

    The priority of position j is uniform(fold_in(key, j)): it depends on j alone, so the order of the real
    samples is the same however much padding follows them. ``bound``: an int scalar >= ``count``, the same for
    every lane of a ``vmap`` (not batched: e.g. the longest client of a lane chunk); the order is then sorted
    over the shortest length of ``permutation_lengths(m)`` that holds ``bound`` and continued with the positions
    past it in order, which is the same permutation at O(L log L) instead of O(M log M) (M, the population's
    longest client, can be 30x a typical client's count).
    """
    def sorted_over(length):
        def order(count):
            head = jnp.argsort(jnp.where(jnp.arange(length) < count, position_uniforms(key, length), 2.0))
            return head if length == m else jnp.concatenate([head, jnp.arange(length, m, dtype=head.dtype)])
        return order

    lengths = permutation_lengths(m)
    if bound is None or len(lengths) == 1:
        return sorted_over(m)(count)
    which = jnp.searchsorted(jnp.asarray(lengths, jnp.int32), jnp.asarray(bound, jnp.int32))
    return jax.lax.switch(jnp.minimum(which, len(lengths) - 1), [sorted_over(n) for n in lengths], count)


def permutation_lengths(m: int, smallest: int = 64) -> tuple[int, ...]:
    """The sort lengths ``epoch_permutation`` chooses from for M padded positions: M and its halvings
    ceil(M / 2^j) down to ``smallest`` (ascending; below it a sort costs less than choosing)."""
    lengths = [m]
    while lengths[-1] // 2 >= smallest:
        lengths.append(-(-lengths[-1] // 2))
    return tuple(sorted(set(lengths)))


@flax.struct.dataclass
class ClientRows:
    """One client's samples as row indices into a flat store (the ``Stacked`` backend): the same data as
    ``ClientData(store_x[rows], store_y[rows], count)``, but a minibatch reads only its own rows
    (``batch``), so a round never copies the cohort's samples padded to the population's longest client.

    ``x`` and ``y`` give the padded arrays (gathered when read), so an algorithm that reads them directly sees
    a ``ClientData``'s fields; ``work`` is ``ClientData.work``.
    """
    store_x: jax.Array
    store_y: jax.Array
    rows: jax.Array
    count: jax.Array
    work: jax.Array | None = None
    bound: jax.Array | None = None  # >= count, shared by the lanes of a vmap (``epoch_permutation``)

    @property
    def x(self):
        return self.store_x[self.rows]

    @property
    def y(self):
        return self.store_y[self.rows]

    @property
    def length(self) -> int:
        return self.rows.shape[-1]

    def sample_mask(self):
        """1.0 for real samples, 0.0 for padding: [..., M] (as ``ClientData.sample_mask``)."""
        return (jnp.arange(self.length) < self.count[..., None]).astype(jnp.float32)

    def batch(self, idx):
        r = self.rows[idx]
        return self.store_x[r], self.store_y[r]


def num_positions(data) -> int:
    """M, the padded positions of one client's ``ClientData`` or ``ClientRows`` (static)."""
    return data.length if isinstance(data, ClientRows) else data.y.shape[0]


def batch_of(data, idx):
    """(x, y) of the padded positions ``idx`` of one client's ``ClientData`` or ``ClientRows``."""
    if isinstance(data, ClientRows):
        return data.batch(idx)
    return data.x[idx], data.y[idx]


def local_epochs(work, epochs: int):
    """The epochs a client runs of a local training phase of E = ``epochs``, given its share ``work`` in [0, 1]
    (``ClientData.work``): 1 + floor(work (E - 1)), so work 1 runs all E and work ~ U[0, 1) runs 1..E-1 epochs
    with equal chance (FedProx's stragglers). work: float [...] -> int32 [...]."""
    return 1 + jnp.floor(jnp.asarray(work, jnp.float32) * (epochs - 1)).astype(jnp.int32)


def client_epochs(data, epochs: int):
    """The epochs (or, for a method that counts local steps, the steps) one client runs of a local training
    phase of ``epochs``: all of them (the static int) unless ``data.work`` is given (``local_epochs``)."""
    return epochs if data.work is None else local_epochs(data.work, epochs)


def scan_first(body, carry, xs, runs):
    """``jax.lax.scan(body, carry, xs)`` in which only the first ``runs`` iterations act: a later one leaves the
    carry as it is and outputs zeros (a straggler's shortened loop of a method that scans its own local work).
    ``runs`` a Python int (``client_epochs`` of a client that does not straggle): the plain scan, all of it.
    Returns (carry, stacked outputs)."""
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    if isinstance(runs, int):
        assert runs == n, (runs, n)
        return jax.lax.scan(body, carry, xs)

    def skipped(c, x):
        out = jax.eval_shape(body, c, x)[1]
        return c, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out)

    def step(c, ix):
        i, x = ix
        return jax.lax.cond(i < runs, body, skipped, c, x)

    return jax.lax.scan(step, carry, (jnp.arange(n), xs))


AUGMENT_STREAM = 0x61756700  # fold_in(step key, this): a minibatch's augmentation draws (apart from the loss's)


def tail_sizes(batch_size: int) -> tuple[int, ...]:
    """The batch sizes a client's partial last batch may be computed at (``LocalTrainer.tail_sizes``), ascending,
    B last: the eighths ceil(k B / 8), k = 1..8, those >= 2 (or B; the halvings B / 2^k, k <= 3, among them). A
    last batch of r real samples runs at the smallest size >= r: fewer than max(ceil(B / 8), 2) padded samples
    instead of B - r. A run compiles only the sizes its clients' last batches take (``buckets.tails_used``)."""
    sizes = {-(-k * batch_size // 8) for k in range(1, 9)}
    return tuple(sorted(s for s in sizes if s >= 2 or s == batch_size))


def draws_from_key(loss_fn, *args) -> bool:
    """Whether ``loss_fn(*args)``'s outputs depend on its last argument (the step key: dropout, a sampled
    representation, ...), read off its jaxpr after dead-code elimination. True when that cannot be told."""
    try:
        from jax._src.interpreters import partial_eval as pe
        closed = jax.make_jaxpr(loss_fn)(*args)
        _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
        return bool(used[-1])
    except Exception:  # (a jax without this internal API, or a function make_jaxpr cannot trace alone)
        return True


def jaxpr_primitives(jaxpr):
    """The name of every equation's primitive in ``jaxpr`` (a ``Jaxpr``), sub-jaxprs (loop bodies, branches,
    ...) included, in order."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from jaxpr_primitives(sub)


def draws_random(fn, *args) -> bool:
    """Whether ``fn(*args)`` draws random numbers (a PRNG primitive anywhere in its jaxpr, ``jaxpr_primitives``:
    draws take their shape from the batch, so a smaller batch would draw others). True when that cannot be told."""
    try:
        names = jaxpr_primitives(jax.make_jaxpr(fn)(*args).jaxpr)
        return any(n.startswith("random_") or n == "threefry2x32" for n in names)
    except Exception:  # (a function make_jaxpr cannot trace alone)
        return True


@dataclasses.dataclass(frozen=True)
class LocalTrainer:
    """Minibatch optimisation of one client, as PyTorch's DataLoader(shuffle=True, drop_last=False) would.

    A client with n real samples takes ``ceil(n / batch_size)`` steps per epoch, its last batch partial: the
    step loop's trip count is the client's own (a ``while`` loop), so no step whose batch is all padding is
    computed. Under ``lax.map`` every client runs exactly its own steps; under ``vmap`` a group of clients
    runs until its longest client is done (the engine groups clients of similar size for that reason).
    The padded length M of ``data`` only bounds the step count (M / batch_size, rounded up). A straggler
    (``data.work`` given) runs ``local_epochs(work, epochs)`` of the epochs.
    With ``dp`` (``jaxfl.core.dpsgd``) every step is a DP-SGD step: a Poisson-sampled batch, per-sample
    gradients clipped, summed and noised; the steps per epoch stay ceil(n / batch_size).
    ``max_steps``: at most this many optimizer steps in all (the epochs run in order, the last one cut short):
    a fine-tuning budget in steps (None: every step of every epoch).
    ``tx``: a ``ClientOptimizer`` (kept as ``optimizer``, its transformation as ``tx``: algorithms read the
    learning rate and momentum there) or any optax transformation (``optimizer`` None: an algorithm whose update
    divides by the learning rate then takes it as its own option).
    ``augment``: ``augment(key, x) -> x``, applied to every training minibatch's raw inputs before ``preprocess``
    (``jaxfl.ops.augment``), its key ``fold_in(step key, AUGMENT_STREAM)`` (None: the inputs as they are).
    ``tail_sizes``: batch sizes (ascending, the last B; ``tail_sizes(B)``) a partial last batch may run at: a
    step of r < B real samples is computed on the smallest that holds them (``lax.switch``), its padding masked
    as in a full batch, so the same step up to float reassociation at a fraction of the work. For clients run
    one at a time (``lax.map``): under ``vmap`` a switch computes every branch. Used only where the step cannot
    tell the difference: no augmentation and a loss that draws nothing from its key (``draws_from_key``; a
    draw's shape would change with the batch); () or None: every step at B. ``tail_log``: a list each traced
    ``run`` appends the sizes it used to (``tails_in_use``: what the engine's ``padded_work`` counts).
    """
    tx: optax.GradientTransformation
    batch_size: int
    epochs: int
    preprocess: Callable = normalizer()
    dp: SampleDP | None = None
    max_steps: int | None = None
    optimizer: ClientOptimizer | None = None
    augment: Callable | None = None
    tail_sizes: tuple[int, ...] | None = None
    tail_log: list | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if isinstance(self.tx, ClientOptimizer):
            object.__setattr__(self, "optimizer", self.tx)
            object.__setattr__(self, "tx", self.tx.transform())

    def usable_tail_sizes(self, loss_fn, params, state, data, key) -> tuple[int, ...]:
        """``tail_sizes`` where a smaller last batch computes the same step (no DP-SGD, no augmentation, a loss
        that draws nothing from its key; sizes above B dropped, B last), else () (every step at B)."""
        b = self.batch_size
        sizes = tuple(s for s in (self.tail_sizes or ()) if s < b)
        used: tuple[int, ...] = ()
        if sizes and self.dp is None and self.augment is None:
            x, y = batch_of(data, jnp.zeros(b, jnp.int32))
            if not draws_from_key(loss_fn, params, state, self.preprocess(x), y, jnp.ones(b, jnp.float32), key):
                used = sizes + (b,)
        if self.tail_log is not None:  # (what ``tails_in_use`` reads: one entry a traced call)
            self.tail_log.append(used)
        return used

    def tails_in_use(self) -> tuple[int, ...]:
        """The sizes every ``run`` traced so far computed its partial last batches at (``tail_sizes`` with B
        last), or () if one of them ran every step at B, none was traced, or no ``tail_log`` was given (a list
        the trainer appends its choice to at each trace; shared by ``dataclasses.replace`` copies)."""
        log = self.tail_log or [()]
        return log[0] if all(entry == log[0] for entry in log) else ()

    def augmented(self, batch, step_key):
        """A minibatch (x, y) with ``augment`` applied to x (its key: ``fold_in(step_key, AUGMENT_STREAM)``)."""
        if self.augment is None:
            return batch
        x, y = batch
        return self.augment(jax.random.fold_in(step_key, AUGMENT_STREAM), x), y

    def run(self, loss_fn, params, state, opt_state, data: ClientData, key, epochs=None):
        """Train one client.

        loss_fn(params, state, x, y, w, key) -> (loss, (new_state, logits)); w [B] is 1 for real samples.
        epochs: how many epochs to run (an int, possibly traced; 0 runs none); None: ``client_epochs(data,
        self.epochs)``, all of them unless the client straggles.
        Returns (params, state, opt_state, metrics) with metrics {"loss", "accuracy", "seen", "steps"}: loss
        and accuracy are means over the real training samples seen this round, ``steps`` the optimizer steps.
        """
        b = self.batch_size
        m = num_positions(data)
        epochs = client_epochs(data, self.epochs) if epochs is None else epochs
        slots = -(-m // b) * b  # the permutation padded to whole batches (indices past m are never real)
        n_steps = (data.count + b - 1) // b
        steps_in = lambda e: n_steps  # noqa: E731  (epoch e's steps)
        if self.max_steps is not None:  # the budget: the epochs it reaches, the last one cut short
            per = jnp.maximum(n_steps, 1)
            epochs = jnp.minimum(epochs, (self.max_steps + per - 1) // per)
            steps_in = lambda e: jnp.clip(self.max_steps - e * n_steps, 0, n_steps)  # noqa: E731
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def private_epoch(e, carry):  # DP-SGD: each step its own Poisson draw (no epoch permutation)
            ekey = jax.random.fold_in(key, e)
            rate = poisson_rate(data.count, b)

            def step(t, carry):
                params, state, opt_state, sums = carry
                skey = jax.random.fold_in(ekey, t + 1)
                members = poisson_members(jax.random.fold_in(skey, SELECT_STREAM), data.count, m, rate)
                grads, step_sums = private_gradient(loss_fn, params, state,
                                                    lambda idx: self.augmented(batch_of(data, idx), skey),
                                                    self.preprocess, members, data.count, skey, self.dp, b, rate)
                updates, opt_state = self.tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), state, opt_state, sums + step_sums

            return jax.lax.fori_loop(0, steps_in(e), step, carry)

        sizes = self.usable_tail_sizes(loss_fn, params, state, data, key)

        def epoch(e, carry):
            ekey = jax.random.fold_in(key, e)
            perm = epoch_permutation(jax.random.fold_in(ekey, 0), data.count, m, getattr(data, "bound", None))
            perm = jnp.pad(perm, (0, slots - m))

            def step_at(size):  # a step on the ``size`` slots from t * b (the real ones first, the rest masked)
                def step(t, carry):
                    params, state, opt_state, sums = carry
                    start = t * b
                    idx = jax.lax.dynamic_slice(perm, (start,), (size,))
                    w = ((start + jnp.arange(size)) < data.count).astype(jnp.float32)
                    skey = jax.random.fold_in(ekey, t + 1)
                    x, y = self.augmented(batch_of(data, idx), skey)
                    (loss, (new_state, logits)), grads = grad_fn(params, state, self.preprocess(x), y, w, skey)
                    # (under jax_enable_x64 BatchNorm's statistics come back float64: the carry keeps its types)
                    state = jax.tree_util.tree_map(lambda new, old: new.astype(old.dtype), new_state, state)
                    updates, opt_state = self.tx.update(grads, opt_state, params)
                    params = optax.apply_updates(params, updates)
                    n = jnp.sum(w)
                    sums = sums + jnp.stack([loss * n, correct_count(logits, y, w), n, 1.0]).astype(sums.dtype)
                    return params, state, opt_state, sums
                return step

            if len(sizes) <= 1:
                return jax.lax.fori_loop(0, steps_in(e), step_at(b), carry)

            small = sizes[:-1]  # (B last)

            def tail(t, carry):  # the partial last batch at the smallest size below B that holds its real samples
                real = jnp.clip(data.count - t * b, 1, small[-1])
                which = jnp.searchsorted(jnp.asarray(small, jnp.int32), real.astype(jnp.int32))
                return jax.lax.switch(which, [step_at(s) for s in small], t, carry)

            # the full batches at B, and with them a partial one that no smaller size holds; then (if the epoch
            # reaches it) the partial one at a smaller size: no branch on a step at B
            partial = data.count % b
            at_b = data.count // b + jnp.where(partial > small[-1], 1, 0)
            full = jnp.minimum(steps_in(e), at_b)
            carry = jax.lax.fori_loop(0, full, step_at(b), carry)
            return jax.lax.fori_loop(full, steps_in(e), tail, carry)

        init = (params, state, opt_state, jnp.zeros(4, jnp.float32))
        params, state, opt_state, sums = jax.lax.fori_loop(0, epochs, epoch if self.dp is None else private_epoch,
                                                           init)
        seen = jnp.maximum(sums[2], 1.0)
        return params, state, opt_state, {"loss": sums[0] / seen, "accuracy": sums[1] / seen,
                                          "seen": sums[2], "steps": sums[3]}
