"""Systems heterogeneity (``--stragglers``, FedProx's section 5.2): who straggles, how many epochs a straggler
runs, that every way of local training honours it, and the run through the CLI."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_trees_close, info, make_separable, make_trainer, ragged, rounding_tolerance,
                      rounds_tolerance, setup_algorithm)

from jaxfl.core.backends import ClientStore
from jaxfl.core.cohort import straggler_work
from jaxfl.core.trainer import local_epochs
from jaxfl.data.clients import ClientData
from jaxfl.models import small_cnn


ROOT = jax.random.key(11)


def test_straggler_work_is_each_clients_own_draw_with_the_asked_chance():
    ids = jnp.arange(4000)
    draw = jax.jit(straggler_work, static_argnums=3)
    np.testing.assert_array_equal(draw(ROOT, 0, ids, 0.0), np.ones(4000, np.float32))
    everyone = np.asarray(draw(ROOT, 0, ids, 1.0))
    assert everyone.max() < 1.0 and everyone.min() >= 0.0
    # the share of a straggler is U[0, 1): its mean 1/2, its deciles even
    assert abs(everyone.mean() - 0.5) < 0.02 and np.all(np.abs(np.histogram(everyone, 10, (0, 1))[0] - 400) < 80)
    work = np.asarray(draw(ROOT, 0, ids, 0.3))
    slow = work < 1.0
    assert abs(slow.mean() - 0.3) < 0.03  # binomial std 0.007
    # a client's draw depends on its id and the round only, not on the cohort it is drawn with
    np.testing.assert_array_equal(np.asarray(draw(ROOT, 0, jnp.array([7, 1234]), 0.3)), work[[7, 1234]])
    assert not np.array_equal(np.asarray(draw(ROOT, 1, ids, 0.3)), work)
    # the same clients straggle at every fraction's threshold: a larger fraction adds stragglers
    assert np.all(np.asarray(draw(ROOT, 0, ids, 0.6)) <= work)


def test_local_epochs_runs_all_for_work_one_and_one_to_e_minus_one_evenly_otherwise():
    e = 5
    share = (jnp.arange(4) + 0.5) / 4  # one value in each quarter of [0, 1)
    np.testing.assert_array_equal(jax.jit(jax.vmap(lambda w: local_epochs(w, e)))(share), [1, 2, 3, 4])
    assert int(local_epochs(1.0, e)) == e and int(local_epochs(0.0, e)) == 1
    assert int(local_epochs(0.999, 1)) == 1  # a phase of one epoch is never shortened


def test_a_straggler_runs_the_first_epochs_of_the_full_run():
    """Work w trains exactly the first 1 + floor(w (E - 1)) epochs of the E-epoch run (same keys, same batches)."""
    from jaxfl.algorithms._common import ce_loss
    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    _, data, server, _ = setup_algorithm("fedavg", model, (24, 17, 9))
    loss, p, stats, key = ce_loss(model), server["params"], server["batch_stats"], jax.random.key(2)
    one = ClientData(data.x[0], data.y[0], data.count[0])

    def run(epochs, work=None):  # -> the jitted run, a function of the float states (p, stats)
        trainer = make_trainer(epochs=epochs)
        d = ClientData(one.x, one.y, one.count, None if work is None else jnp.float32(work))
        return jax.jit(lambda p, stats: trainer.run(loss, p, stats, trainer.tx.init(p), d, key))

    def assert_same_run(got, reference):  # another program: equal up to float32 rounding of the reference run
        assert_trees_close(got, reference(p, stats)[0], atol=rounding_tolerance(reference, p, stats)[0], rtol=0)

    straggling, two = run(4, 0.4)(p, stats), run(2)  # 1 + floor(0.4 * 3) = 2 of 4 epochs
    assert float(straggling[3]["steps"]) == 2 * 3 == float(two(p, stats)[3]["steps"])  # 24 samples, batch 8
    assert_same_run(straggling[0], two)
    full = run(4, 1.0)(p, stats)
    assert float(full[3]["steps"]) == 12
    assert_same_run(full[0], run(4))


@pytest.mark.parametrize("name,opts,full,slow", [
    ("fedavg", {}, 9, 3),                        # E = 3 epochs of 3 batches; work 0: 1 epoch
    ("perfedavg", {"beta": 0.3}, 3, 1),           # its own epoch loop: 1 meta-step (3 batches) an epoch
    ("pfedhn", {"inner_steps": 6}, 6, 1),          # its inner steps (work 0: one step)
    ("pfedgp", {"inner_steps": 3, "train_draws": 4, "test_draws": 4, "gibbs_steps": 2}, 3, 1),  # full-batch steps
])
def test_every_kind_of_local_training_runs_less_for_a_straggler(name, opts, full, slow):
    alg, data, server, clients = setup_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)),
                                                 (24, 24), epochs=3, options=opts)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)

    def update(work):
        d = ClientData(data.x[0], data.y[0], data.count[0], work)
        return jax.jit(lambda d: alg.local_update(server, client, d, jax.random.key(1), info(0, 0)))(d)

    whole, part = update(None), update(jnp.float32(0.0))  # (work 1 = everything: the trainer's test above)
    assert float(whole[1]["steps"]) == full and float(part[1]["steps"]) == slow
    moved = sum(float(jnp.sum(jnp.abs(jnp.float32(a) - jnp.float32(b))))
                for a, b in zip(jax.tree_util.tree_leaves(whole[0]), jax.tree_util.tree_leaves(part[0])))
    assert moved > 0


def test_fedselect_straggler_runs_its_first_alternations():  # (its LocalAlt loop, not the trainer's epochs)
    shared = dict(epochs=1)
    alg3, data, server, clients = setup_algorithm("fedselect", small_cnn(num_classes=4, width=4, hidden=(8,)),
                                                  (24, 24), options={"la_epochs": 3}, **shared)
    alg2, *_ = setup_algorithm("fedselect", small_cnn(num_classes=4, width=4, hidden=(8,)), (24, 24),
                               options={"la_epochs": 2}, **shared)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    straggler = _update_fn(alg3, data, 0.6)(server, client)  # 1 + floor(0.6 * 2) = 2 of 3
    two = _update_fn(alg2, data, None)
    # another program: equal up to float32 rounding of the two alternations' run
    assert_trees_close(straggler[0], two(server, client)[0], atol=rounding_tolerance(two, server, client)[0], rtol=0)


def test_both_backends_give_stragglers_the_same_rounds():
    from jaxfl.core.backends import Ragged, Stacked
    counts = (24, 17, 9, 30)
    alg, _, server, clients = setup_algorithm("fedprox", small_cnn(num_classes=4, width=4, hidden=(8,)), counts,
                                              epochs=3, options={"mu": 0.1})
    data = ragged(make_separable(counts))
    out = {}
    for engine in (Stacked(alg, data, batch_size=8, clients="map", stragglers=0.5),
                   Ragged(alg, data, batch_size=8, clients="vmap", stragglers=0.5, client_store="device")):
        s, store = server, ClientStore(jax.tree_util.tree_map(jnp.array, clients), "device")
        steps = []
        for r in range(3):
            s, m = engine.round(s, store, r, ROOT)
            steps.append(np.asarray(m["steps"]).tolist())
        out[type(engine).__name__] = (s, steps)
    # two programs (map over clients, vmap lanes): equal up to float32 rounding of the three rounds
    tol = rounds_tolerance(alg, make_separable(counts), server, clients, ROOT, rounds=3, stragglers=0.5)[0]
    assert_trees_close(out["Stacked"][0], out["Ragged"][0], atol=tol, rtol=0)
    assert out["Stacked"][1] == out["Ragged"][1]
    per_epoch = np.array([3, 3, 2, 4])  # ceil(n / 8) batches; E = 3
    steps = np.array(out["Stacked"][1])
    # every straggler runs 1 or 2 whole epochs of its 3, the others all 3; some of the 12 straggle
    assert np.all(steps % per_epoch == 0) and np.all(steps <= 3 * per_epoch) and np.any(steps < 3 * per_epoch)


def test_cli_stragglers_shorten_some_clients_rounds(tmp_path):
    from jaxfl.run.cli import main
    assert main(["run", "--quiet", "--algorithm", "fedavg", "--rounds", "3", "--local-epochs", "3",
                 "--stragglers", "0.5", "--out", str(tmp_path / "r"), "--model", "small_cnn", "--image-size", "12",
                 "--samples-per-client", "40", "--batch-size", "16", "--test-per-client", "30"]) == 0
    logs = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = np.array([r["train_steps"] for r in logs])  # 3 clients x 3 rounds; 40 samples: 3 batches an epoch
    assert set(steps.ravel().tolist()) <= {3.0, 6.0, 9.0} and 9.0 in steps and steps.min() < 9
    # train_samples: the real samples each client trained, 40 an epoch over the epochs it ran (3 steps each)
    np.testing.assert_array_equal([r["train_samples"] for r in logs], steps / 3 * 40)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["stragglers"] == 0.5


def test_scan_first_acts_on_the_first_runs_iterations_under_jit_vmap_and_grad():
    from jaxfl.core.trainer import scan_first
    body = lambda c, x: (c * x + 1.0, c * x)  # carry c -> c x + 1, output c x
    xs = jnp.array([2.0, 3.0, 5.0, 7.0])

    def by_hand(c, k):
        outs = []
        for x in xs[:k]:
            outs.append(c * x)
            c = c * x + 1.0
        return c, jnp.array(outs + [0.0] * (4 - k))

    f = jax.jit(lambda c, k: scan_first(body, c, xs, k))
    for k in range(5):
        c, out = f(jnp.float32(1.5), k)
        want_c, want_out = by_hand(1.5, k)
        np.testing.assert_allclose(c, want_c, rtol=1e-6)
        np.testing.assert_allclose(out, want_out, rtol=1e-6)
    # lanes with different run counts, and the gradient through the carry: d c_k / d c_0 = prod of the first k xs
    cs, _ = jax.vmap(f)(jnp.ones(3, jnp.float32), jnp.array([0, 2, 4]))
    np.testing.assert_allclose(cs, [by_hand(1.0, k)[0] for k in (0, 2, 4)], rtol=1e-6)
    grads = jax.vmap(jax.grad(lambda c, k: f(c, k)[0]))(jnp.ones(3, jnp.float32), jnp.array([0, 2, 4]))
    np.testing.assert_allclose(grads, [1.0, 6.0, 210.0], rtol=1e-6)


def _update_fn(alg, data, work):
    """Client 0's local update with ``work`` (None: all its epochs), jitted, a function of (server, client)."""
    d = ClientData(data.x[0], data.y[0], data.count[0], None if work is None else jnp.float32(work))
    return jax.jit(lambda server, client: alg.local_update(server, client, d, jax.random.key(1), info(0, 0)))


def _update(alg, data, server, clients, work):
    return _update_fn(alg, data, work)(server, jax.tree_util.tree_map(lambda a: a[0], clients))


def _update_tolerance(alg, data, server, clients, work):
    """``rounding_tolerance`` of ``_update``: for comparing another program's update of the same math with it."""
    return rounding_tolerance(_update_fn(alg, data, work), server, jax.tree_util.tree_map(lambda a: a[0], clients))


def test_a_dapperfl_straggler_runs_its_epochs_in_all_dense_first():
    """DapperFL's E epochs are 1 dense + E - 1 masked: a straggler's e of them are 1 dense + e - 1 masked, so
    e = 1 is the run of E = 1 (no masked epoch)."""
    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    alg3, data, server, clients = setup_algorithm("dapperfl", model, (24, 24), epochs=3)
    alg1, *_ = setup_algorithm("dapperfl", model, (24, 24), epochs=1)
    one_epoch = _update(alg3, data, server, clients, 0.0)  # 1 + floor(0 * 2) = 1
    assert_trees_close(one_epoch, _update(alg1, data, server, clients, None),
                       atol=_update_tolerance(alg1, data, server, clients, None), rtol=0)
    assert float(_update(alg3, data, server, clients, 0.5)[1]["steps"]) == 3  # 2 epochs: 1 masked of 3 batches
    assert float(_update(alg3, data, server, clients, None)[1]["steps"]) == 6  # 2 masked epochs


def test_the_evaluation_fine_tune_runs_all_its_epochs_for_a_straggler():
    alg, data, server, clients = setup_algorithm("fedavg_ft", small_cnn(num_classes=4, width=4, hidden=(8,)),
                                                 (24, 24), epochs=3)
    whole, straggler = _update(alg, data, server, clients, None), _update(alg, data, server, clients, 0.0)
    assert float(straggler[1]["steps"]) == 3 and float(whole[1]["steps"]) == 9  # the training is shortened
    tol = _update_tolerance(alg, data, server, clients, None)[0]["tuned"]  # (another program: up to rounding)
    assert_trees_close(straggler[0]["tuned"], whole[0]["tuned"], atol=tol, rtol=0)  # the fine-tune is not


def test_a_step_budget_runs_the_first_steps_of_the_full_run():
    """``LocalTrainer.max_steps`` = K: the first K optimizer steps of the same epochs (same keys, same batches),
    the last epoch cut short; a budget past the run's steps changes nothing."""
    import dataclasses

    from jaxfl.algorithms._common import ce_loss
    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    _, data, server, _ = setup_algorithm("fedavg", model, (24, 17, 9))
    loss, p, stats, key = ce_loss(model), server["params"], server["batch_stats"], jax.random.key(2)
    one = ClientData(data.x[0], data.y[0], data.count[0])  # 24 samples, batch 8: 3 steps an epoch

    def run(epochs, max_steps=None):  # -> the jitted run, a function of the float states (p, stats)
        trainer = dataclasses.replace(make_trainer(epochs=epochs), max_steps=max_steps)
        return jax.jit(lambda p, stats: trainer.run(loss, p, stats, trainer.tx.init(p), one, key))

    reference = run(2)
    cut, whole = run(4, 6)(p, stats), reference(p, stats)  # 6 steps of a 4-epoch run = its first 2 epochs
    tol = rounding_tolerance(reference, p, stats)[0]  # (other programs: equal up to float32 rounding of the run)
    assert float(cut[3]["steps"]) == 6 == float(whole[3]["steps"])
    assert_trees_close(cut[0], whole[0], atol=tol, rtol=0)
    partial = run(4, 4)(p, stats)  # 2 epochs' worth would be 6: the second epoch stops after its first step
    assert float(partial[3]["steps"]) == 4 and float(partial[3]["seen"]) == 24 + 8
    assert not np.allclose(jax.tree_util.tree_leaves(partial[0])[0], jax.tree_util.tree_leaves(whole[0])[0])
    budget = run(2, 100)(p, stats)
    assert float(budget[3]["steps"]) == 6
    assert_trees_close(budget[0], whole[0], atol=tol, rtol=0)
