"""FedSelect: per-entry masked aggregation, growth rule and schedule, LocalAlt isolation, reduction to FedAvg."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (assert_trees_close, info, make_data, make_trainer, round_function, rounding_tolerance,
                      rounds_tolerance, run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms.fedselect import is_maskable, mask_updates
from jaxfl.core.step import init_state
from jaxfl.core.trees import path_mask
from jaxfl.models import small_cnn


ROOT = jax.random.key(3)
COUNTS = (24, 17, 9)


class MLP(nn.Module):
    """A BatchNorm-free model (FedSelect's FedAvg reduction holds exactly only without BN statistics)."""
    @nn.compact
    def __call__(self, x, train=False, mask=None):
        x = nn.relu(nn.Dense(8)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(x)


def setup(model=None, **opts):
    data = make_data(list(COUNTS))
    trainer = make_trainer(lr=0.05, momentum=0.5)
    alg = build_algorithm("fedselect", model or small_cnn(num_classes=4, width=4, hidden=(8,)), trainer, **opts)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
    return alg, data, server, clients


def test_per_entry_mean_matches_a_hand_computed_three_client_example():
    alg = build_algorithm("fedselect", MLP(), make_trainer())
    theta = jnp.array([[1., 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    personal = jnp.array([[0, 1, 0, 1], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    server = {"params": {"w": jnp.full(4, -1.0)}}
    clients = {"params": {"w": theta}, "mask": {"w": personal}, "pending": {"w": personal}}
    new_server, new_clients = alg.aggregate(server, clients, jnp.array([24., 17., 9.]),  # unweighted by default
                                            info(0, [0, 1, 2], num_rounds=10))
    # entry 0: global for clients 0, 1 -> (1 + 5) / 2; entry 1: clients 1, 2 -> 8; entry 2: clients 0, 2 -> 7;
    # entry 3: personal everywhere -> clients keep theirs, the server keeps its previous value
    np.testing.assert_array_equal(new_clients["params"]["w"], [[3, 2, 7, 4], [3, 8, 7, 8], [9, 8, 7, 12]])
    np.testing.assert_array_equal(new_server["params"]["w"], [3, 8, 7, -1])


def test_personal_entries_are_untouched_and_the_last_round_does_not_aggregate():
    alg = build_algorithm("fedselect", MLP(), make_trainer())
    theta = jax.random.normal(jax.random.key(1), (3, 50))
    personal = jax.random.bernoulli(jax.random.key(2), 0.4, (3, 50))
    clients = {"params": {"w": theta}, "mask": {"w": personal}, "pending": {"w": personal}}
    server = {"params": {"w": jnp.zeros(50)}}
    _, out = alg.aggregate(server, clients, jnp.ones(3), info(1, [0, 1, 2], num_rounds=3))
    np.testing.assert_array_equal(np.where(personal, out["params"]["w"], 0), np.where(personal, theta, 0))
    last_server, last = alg.aggregate(server, clients, jnp.ones(3), info(2, [0, 1, 2], num_rounds=3))
    np.testing.assert_array_equal(last["params"]["w"], theta)
    np.testing.assert_array_equal(last_server["params"]["w"], server["params"]["w"])


def test_alpha_zero_is_fedavg_with_uniform_weights():
    data = make_data(list(COUNTS))
    trainer = make_trainer(lr=0.05, momentum=0.5)
    select = build_algorithm("fedselect", MLP(), trainer, alpha=0.0, grow_every=1)
    avg = build_algorithm("fedavg", MLP(), trainer)
    outs = []
    for alg in (select, avg):
        server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
        outs.append(run_rounds(alg, data, server, clients, ROOT, rounds=3, weighting="uniform", num_rounds=10))
    (s_sel, c_sel, m_sel), (s_avg, _, m_avg) = outs
    # two programs for the same math: equal up to float32 rounding of FedAvg's three rounds
    server, clients = init_state(avg, jax.random.key(0), data.x[0], len(COUNTS))
    tol = rounds_tolerance(avg, data, server, clients, ROOT, rounds=3, weighting="uniform", num_rounds=10)[0]
    assert_trees_close(s_sel["params"], s_avg["params"], atol=tol["params"], rtol=0)
    for i in range(len(COUNTS)):  # every client holds the broadcast average
        assert_trees_close(jax.tree_util.tree_map(lambda a: a[i], c_sel["params"]), s_avg["params"],
                           atol=tol["params"], rtol=0)
    # (the logged loss differs by design: FedSelect logs the mean of its personal and global passes)
    assert not any(bool(jnp.any(m)) for m in jax.tree_util.tree_leaves(c_sel["mask"]))


def test_growth_adds_the_top_rate_fraction_of_each_maskable_tensor():
    p = 0.25
    alg, data, server, clients = setup(grow_every=1, alpha=0.9, grow_rate=p)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    row = jax.tree_util.tree_map(lambda a: a[0], data)
    new, metrics = jax.jit(alg.local_update)(server, client, row, jax.random.key(9), info(1, 0, 10))
    eligible = path_mask(client["params"], is_maskable)
    for e, m, now, ref in zip(*(jax.tree_util.tree_leaves(t) for t in (eligible, new["pending"], new["params"],
                                                                         client["params"]))):
        m = np.asarray(m)
        if not e:  # biases: always global
            assert not m.any()
            continue
        d = np.abs(np.asarray(now) - np.asarray(ref)).ravel()
        cut = np.sort(d)[int(np.round((1 - p) * d.size))]
        np.testing.assert_array_equal(m.ravel(), d >= cut)  # the rule, from numpy
        if len(np.unique(d)) == d.size:  # distinct deltas: exactly n_g - round((1 - p) n_g) entries
            assert m.sum() == d.size - np.round((1 - p) * d.size)
    np.testing.assert_array_equal(new["ref"]["encoder"]["conv1"]["kernel"], new["params"]["encoder"]["conv1"]["kernel"])
    assert 0 < float(metrics["personal_fraction"]) < 0.3


def test_mask_biases_lets_biases_grow_and_batch_stats_can_be_averaged():
    alg, data, server, clients = setup(grow_every=1, alpha=0.9, mask_biases=True, aggregate_batch_stats=True)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    row = jax.tree_util.tree_map(lambda a: a[0], data)
    new, _ = jax.jit(alg.local_update)(server, client, row, jax.random.key(9), info(1, 0, 10))
    biases = [m for path, m in jax.tree_util.tree_flatten_with_path(new["pending"])[0] if path[-1].key == "bias"]
    assert biases and all(np.asarray(m).any() for m in biases)  # the default (test above) never grows them
    # batch statistics: every client gets the weighted mean, except in the final round, which keeps its own
    stats = jax.tree_util.tree_map(lambda a: a + jnp.arange(3.0).reshape((3,) + (1,) * (a.ndim - 1)),
                                   clients["batch_stats"])
    cl = dict(clients, batch_stats=stats)
    w = jnp.array([24., 17., 9.])
    _, out = jax.jit(alg.aggregate)(server, cl, w, info(0, [0, 1, 2], 10))
    for x, y in zip(jax.tree_util.tree_leaves(stats), jax.tree_util.tree_leaves(out["batch_stats"])):
        mean = np.tensordot(np.asarray(w) / 50.0, np.asarray(x), 1)
        np.testing.assert_allclose(y, np.broadcast_to(mean, x.shape), rtol=1e-6)
    _, last = jax.jit(alg.aggregate)(server, cl, w, info(9, [0, 1, 2], 10))
    assert_trees_close(last["batch_stats"], stats, atol=0)
    _, default = setup()[0].aggregate(server, cl, w, info(0, [0, 1, 2], 10))
    assert_trees_close(default["batch_stats"], stats, atol=0)  # the code's rule: statistics stay local


def test_masks_only_grow_on_schedule_and_uploads_shrink():
    alg, data, server, clients = setup(grow_every=2, alpha=0.5)
    fn = round_function(alg, num_rounds=10)
    masks, uploads = [], []
    s, c = server, clients
    for r in range(5):
        s, c, m = fn(s, c, data, r, ROOT)
        masks.append(jax.tree_util.tree_map(np.asarray, c["mask"]))
        uploads.append(np.asarray(m["uploaded"]))
    count = lambda t: sum(int(x.sum()) for x in jax.tree_util.tree_leaves(t))
    counts = [count(m) for m in masks]
    # growth in rounds r = 2 and 4 (r % K == 0, r > 0); the new mask applies from the next round
    assert counts[0] == counts[1] == 0 and counts[2] > 0 and counts[3] == counts[2] and counts[4] > counts[3]
    for a, b in zip(masks, masks[1:]):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert np.all(y >= x)  # personal entries never revert
    assert all(np.all(b <= a) for a, b in zip(uploads, uploads[1:])) and uploads[-1].max() < uploads[0].min()


def test_mask_updates_move_only_masked_entries():
    params = {"w": jnp.ones((3, 4))}
    mask = {"w": jnp.array([[1, 0, 0, 1]] * 3, bool)}
    tx = optax.chain(optax.sgd(0.1, momentum=0.9), mask_updates(mask))
    grads = {"w": jnp.full((3, 4), 2.0)}
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], np.where(mask["w"], -0.2, 0.0))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="alpha=1.5"):
        build_algorithm("fedselect", MLP(), make_trainer(), alpha=1.5)
    with pytest.raises(ValueError, match="delta_ref"):
        build_algorithm("fedselect", MLP(), make_trainer(), delta_ref="start")


def test_frozen_bn_from_trains_with_the_running_statistics_from_that_round_on():
    """The official code trains in eval mode from its second round: BatchNorm normalises with the running
    statistics, which stay as they were. ``frozen_bn_from=1``: round 0 as without the option, round 1 the
    LocalAlt of the eval-mode loss, with the statistics returned unchanged."""
    from jaxfl.algorithms._common import ce_loss
    from jaxfl.algorithms.fedselect import local_alt

    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    trainer = make_trainer(lr=0.05, momentum=0.5)
    frozen = build_algorithm("fedselect", model, trainer, frozen_bn_from=1)
    plain = build_algorithm("fedselect", model, trainer)
    data = make_data(list(COUNTS))
    server, clients = init_state(plain, jax.random.key(0), data.x[0], len(COUNTS))
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    row = jax.tree_util.tree_map(lambda a: a[0], data)
    # stats away from their initial values, as after a first round
    client = dict(client, batch_stats=jax.tree_util.tree_map(lambda s: s + 0.3, client["batch_stats"]))
    key = jax.random.key(9)

    def update(alg, r):
        return jax.jit(alg.local_update)(server, client, row, key, info(r, 0, 10))[0]

    def tol(alg, r):
        return rounding_tolerance(jax.jit(lambda s, c: alg.local_update(s, c, row, key, info(r, 0, 10))[0]),
                                  server, client)

    first, trained = update(frozen, 0), update(plain, 0)
    assert_trees_close(first, trained, atol=tol(plain, 0), rtol=0)
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(trained["batch_stats"]),
                                                            jax.tree_util.tree_leaves(client["batch_stats"]))]
    assert min(moved) > 1e-3  # training mode updates the running statistics

    second = update(frozen, 1)
    assert_trees_close(second["batch_stats"], client["batch_stats"], atol=0, rtol=0)
    start = jax.tree_util.tree_map(lambda m, c, s: jnp.where(m, c, s), client["mask"], client["params"],
                                   server["params"])
    params, _, _ = jax.jit(lambda p, s: local_alt(trainer, ce_loss(model, train=False), p, s, client["mask"], row,
                                                  key, 1))(start, client["batch_stats"])
    assert_trees_close(second["params"], params, atol=tol(frozen, 1)["params"], rtol=0)
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(second["params"]),
                                                             jax.tree_util.tree_leaves(update(plain, 1)["params"])))
    assert gap > 1e-3  # eval-mode training is another trajectory than training mode
