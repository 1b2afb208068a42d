"""Baselines: each one's defining property (what is shared, what stays personal, its reductions)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_trees_close, bit_identity, engine_rounds, make_backend, make_data, make_separable,
                      make_trainer, ragged, rounding_tolerance, rounds_tolerance, run_rounds, setup_algorithm, traces,
                      trained_rows)

from jaxfl.algorithms import REGISTRY
from jaxfl.algorithms._common import ce_loss
from jaxfl.algorithms.fedrep import head_then_body
from jaxfl.core.backends import ClientStore
from jaxfl.core.cohort import client_keys
from jaxfl.core.evaluate import Evaluator, make_evaluate
from jaxfl.core.step import make_step
from jaxfl.core.trainer import jaxpr_primitives, tail_sizes
from jaxfl.models import small_cnn


ROOT = jax.random.key(3)
COUNTS = (24, 17, 9)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))  # a BatchNorm in the head too


def tiny_vit():
    from jaxfl.models import vit_small
    return vit_small(num_classes=4, depth=2, dim=16, heads=2, dim_head=8, mlp_dim=32)


TINY_HYPERNET = dict(embed_dim=4, hyper_hidden=8, hyper_layers=1)
T = 10  # the runs' total rounds, for the algorithms whose schedules need it


def setup(name, tails=False, **opts):
    """(alg, data, server, clients) of ``name`` with options ``opts``; ``tails``: its trainer computes partial last
    batches at the smaller sizes (``LocalTrainer.tail_sizes``)."""
    kw = {"tail_sizes": tail_sizes(8)} if tails else {}
    if name == "fedtp":  # a ViT algorithm
        return setup_algorithm(name, tiny_vit(), COUNTS, num_rounds=T, options=dict(TINY_HYPERNET, **opts), **kw)
    if name == "pfedhn":  # 20 inner steps per round (official 50) keep the test short
        opts = dict(inner_steps=20, **opts)
    if name == "perfedavg":  # one meta-step per round here: a larger outer step than the client lr
        opts = dict(beta=0.3, **opts)
    if name == "pfedgp":  # fewer Gibbs chains and sweeps than the official 20/30 x 5
        opts = dict(train_draws=4, test_draws=4, gibbs_steps=2, **opts)
    return setup_algorithm(name, model(), COUNTS, num_rounds=T, options=opts, **kw)


def run(alg, data, server, clients, rounds=2, **kw):
    return run_rounds(alg, data, server, clients, ROOT, rounds, num_rounds=T, **kw)


def rows_equal(leaf):
    return all(np.array_equal(leaf[0], leaf[i]) for i in range(1, leaf.shape[0]))


def assert_personal(trained, initial):
    """Every leaf differs across clients, except leaves training never moves (a bias feeding a BatchNorm
    has zero gradient); at least one leaf must differ."""
    differ = 0
    for leaf, init in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(initial)):
        if rows_equal(leaf):
            np.testing.assert_array_equal(leaf[0], init)
        else:
            differ += 1
    assert differ > 0


def effective(alg, server, clients):
    """Each client's evaluation model: what predict uses (shared leaves from the server)."""
    x = make_data(list(COUNTS), seed=5).x[:, :8]
    return jax.vmap(lambda c, xx: alg.predict(server, c, xx / 255.0))(clients, x)


def test_every_algorithm_is_offered_by_the_cli_and_documented():
    import re
    from pathlib import Path

    from jaxfl.run.cli import build_parser
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    readme = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    for name, reg in REGISTRY.items():
        shares, keeps = reg.options.sharing
        assert shares and keeps, name
        assert re.search(rf"\b{name}\b", help_text), f"--help does not list {name}"
        assert f"`{name}`" in readme, f"docs/algorithms.md does not document {name}"


@bit_identity("mu = 0 leaves the proximal term out of the loss (ce_loss adds it only when mu != 0): FedProx "
              "traces FedAvg's very program")
def test_fedprox_with_mu_zero_equals_fedavg():
    fedavg, fedprox = setup("fedavg"), setup("fedprox", mu=0.0)

    def jaxpr(alg, data, server, clients):  # the cohort step's
        return str(jax.make_jaxpr(lambda s, c: make_step(alg)(s, c, data, jnp.arange(3), 0, ROOT))(server, clients))
    assert jaxpr(*fedavg) == jaxpr(*fedprox)  # the reason above
    a, b = run(*fedavg), run(*fedprox)
    assert_trees_close(a[:2], b[:2], atol=0, rtol=0)


def test_fedprox_term_pulls_toward_the_round_start():
    alg0, data, server, clients = setup("fedprox", mu=0.0)
    alg1, *_ = setup("fedprox", mu=10.0)
    start = server["params"]
    dist = lambda s: sum(float(jnp.sum((a - b) ** 2)) for a, b in
                         zip(jax.tree_util.tree_leaves(s["params"]), jax.tree_util.tree_leaves(start)))
    d0 = dist(run(alg0, data, server, clients, rounds=1)[0])
    d1 = dist(run(alg1, data, server, clients, rounds=1)[0])
    assert d1 < 0.9 * d0
    # the loss is CE + mu/2 ||w - anchor||^2: check the formula on one batch
    p = jax.tree_util.tree_map(lambda x: x + 0.1, start)
    x, y, w = data.x[0, :8] / 255.0, data.y[0, :8], jnp.ones(8)
    l0 = ce_loss(model())(p, server["batch_stats"], x, y, w, None)[0]
    l1 = ce_loss(model(), 3.0)(p, server["batch_stats"], x, y, w, None, start)[0]
    n = sum(a.size for a in jax.tree_util.tree_leaves(start))
    np.testing.assert_allclose(l1 - l0, 1.5 * n * 0.01, rtol=1e-4)


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_personal_head_is_never_averaged(name):
    alg, data, server, clients = setup(name)
    (s1, _, _), (s, c, _) = run(alg, data, server, clients, every_round=True)
    assert set(c["params"]) == {"head"}  # the client keeps its head and nothing else
    assert_personal(c["params"]["head"], server["params"]["head"])
    # the server's encoder is the weighted mean of the clients' trained encoders (up to float32 rounding)
    trained = trained_rows(alg, data, server, clients, ROOT)
    tol = rounds_tolerance(alg, data, server, clients, ROOT, num_rounds=T)[0]["params"]["encoder"]
    w = np.array(COUNTS, float) / sum(COUNTS)
    for sv, cl, t in zip(jax.tree_util.tree_leaves(s1["params"]["encoder"]),
                         jax.tree_util.tree_leaves(trained["params"]["encoder"]), jax.tree_util.tree_leaves(tol)):
        np.testing.assert_allclose(sv, np.tensordot(w, cl, 1), rtol=0, atol=t)
    # the server's head is the untouched initial head: heads never reach it
    assert_trees_close(s["params"]["head"], server["params"]["head"], atol=0, rtol=0)


def test_fedrep_phases_freeze_the_other_part():
    alg, data, server, clients = setup("fedrep")
    trainer = make_trainer()
    one = server  # the full model a client starts its first round from
    row = data.take(0)
    loss = ce_loss(model())
    for head_epochs, body_epochs, moved, frozen in [(2, 0, "head", "encoder"), (0, 1, "encoder", "head")]:
        import dataclasses
        t = dataclasses.replace(trainer, epochs=body_epochs)
        p, *_ = head_then_body(head_epochs)(t, loss, one["params"], one["batch_stats"], (), row,
                                            jax.random.key(0))
        assert_trees_close(p[frozen], one["params"][frozen], atol=0, rtol=0)
        assert not np.allclose(jax.tree_util.tree_leaves(p[moved])[0],
                               jax.tree_util.tree_leaves(one["params"][moved])[0])


def test_lg_fedavg_never_averages_the_body_after_warmup():
    alg, data, server, clients = setup("lg_fedavg")
    (s1, _, _), (s, c, _) = run(alg, data, server, clients, every_round=True)
    assert set(c["params"]) == {"encoder"}  # the client keeps its body and nothing else
    assert_personal(c["params"]["encoder"], server["params"]["encoder"])
    assert_trees_close(s["params"]["encoder"], server["params"]["encoder"], atol=0, rtol=0)
    trained = trained_rows(alg, data, server, clients, ROOT)
    tol = rounds_tolerance(alg, data, server, clients, ROOT, num_rounds=T)[0]["params"]["head"]  # (float32 rounding)
    w = np.array(COUNTS, float) / sum(COUNTS)
    for sv, cl, t in zip(jax.tree_util.tree_leaves(s1["params"]["head"]),
                         jax.tree_util.tree_leaves(trained["params"]["head"]), jax.tree_util.tree_leaves(tol)):
        np.testing.assert_allclose(sv, np.tensordot(w, cl, 1), rtol=0, atol=t)


def test_lg_fedavg_warmup_rounds_are_fedavg():
    warm = run(*setup("lg_fedavg", warmup_rounds=2))
    avg = run(*setup("fedavg"))
    # two programs for the same math: equal up to float32 rounding of FedAvg's two rounds
    tol = rounds_tolerance(*setup("fedavg"), ROOT, rounds=2, num_rounds=T)[0]["params"]
    assert_trees_close(warm[0]["params"], avg[0]["params"], atol=tol, rtol=0)
    # while warming up a client's model is the global one: each keeps the averaged body
    for leaf, g in zip(jax.tree_util.tree_leaves(warm[1]["params"]["encoder"]),
                       jax.tree_util.tree_leaves(warm[0]["params"]["encoder"])):
        np.testing.assert_array_equal(leaf, np.broadcast_to(g, leaf.shape))
    # a third round is LG: the body stays personal, so the server body no longer moves
    alg, data, *_ = setup("lg_fedavg", warmup_rounds=2)
    store = ClientStore(warm[1], "device")
    s3, _ = make_backend(alg, data, num_rounds=T).round(warm[0], store, 2, ROOT)
    assert_trees_close(s3["params"]["encoder"], warm[0]["params"]["encoder"], atol=0, rtol=0)


@bit_identity("at lambda 0 Ditto's personal loop is Local's loop: the proximal term adds exact zeros")
def test_ditto_with_lambda_zero_has_purely_local_personal_models():
    alg, data, server, clients = setup("ditto", lam=0.0)
    (s1, _, _), (s, c, _) = run(alg, data, server, clients, every_round=True)
    loc = run(*setup("local"))
    assert_trees_close(c["personal"]["params"], loc[1]["params"], atol=0, rtol=0)
    # its global model after round 1 is FedAvg's update on the global key stream fold_in(key_i, 1), by hand
    trainer, loss = make_trainer(), ce_loss(model())
    train = jax.jit(lambda p, st, d, k: trainer.run(loss, p, st, trainer.tx.init(p), d, k)[:2])
    keys = client_keys(ROOT, 0, jnp.arange(len(COUNTS)))
    w = np.array(COUNTS, np.float32) / sum(COUNTS)

    def by_hand(params, stats):
        trained = [train(params, stats, data.take(i), jax.random.fold_in(keys[i], 1)) for i in range(len(COUNTS))]
        return jax.tree_util.tree_map(lambda *leaves: sum(wi * x for wi, x in zip(w, leaves)), *trained)
    expect = by_hand(server["params"], server["batch_stats"])
    tol = rounding_tolerance(by_hand, server["params"], server["batch_stats"])  # (another program: up to rounding)
    assert_trees_close((s1["params"], s1["batch_stats"]), expect, atol=tol, rtol=0)
    assert not np.allclose(s1["params"]["head"]["fc1"]["linear"]["kernel"],
                           server["params"]["head"]["fc1"]["linear"]["kernel"])


def test_ditto_large_lambda_ties_personal_models_to_the_global_one():
    far = run(*setup("ditto", lam=0.0))
    near = run(*setup("ditto", lam=5.0))  # lr * lambda < 1: stable
    gap = lambda out: sum(float(jnp.sum((p - g[None]) ** 2)) for p, g in zip(
        jax.tree_util.tree_leaves(out[1]["personal"]["params"]), jax.tree_util.tree_leaves(out[0]["params"])))
    assert gap(near) < 0.5 * gap(far)


# the two backends agree up to float reassociation (as in test_simulation.py); MOON's contrastive term amplifies
# it over two rounds (2.5e-5 on a weight of 0.01 under XLA:CPU's LLVM IR emitters, which the suite uses)
BACKEND_TOLERANCE = {"moon": dict(atol=1e-4, rtol=1e-2)}
DEFAULT_BACKEND_TOLERANCE = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_algorithm_is_the_same_on_both_backends_and_learns_a_separable_task(name):
    # Stacked (one jit per round, vmap over the cohort) against Ragged under map (one bucket, every client its
    # own step count, partial last batches at the smaller sizes of ``tail_sizes``, where the method's loss allows
    # them): the same numbers after two rounds; then six rounds learn the task. (Buckets of several shapes, and
    # the client store on the host, are checked against Stacked in test_simulation.py.)
    alg, _, server, clients = setup(name)
    data, test = make_separable(COUNTS), make_separable(COUNTS, m=24, seed=1)
    stacked = make_backend(alg, data, "stacked", num_rounds=T)
    by_map = make_backend(setup(name, tails=True)[0], data, "ragged", clients="map", num_rounds=T)
    s, store = server, ClientStore(jax.tree_util.tree_map(jnp.array, clients), "device")
    s_r, store_r = server, ClientStore(jax.tree_util.tree_map(jnp.array, clients), "device")
    seen, traced = {}, []
    for r in range(6):
        with traces() as new:
            s, m = stacked.round(s, store, r, ROOT)
        traced.append(len(new))
        if r < 2:
            hook = lambda server, trained, ids: seen.update(server=server, trained=trained)
            s_r, _ = by_map.round(s_r, store_r, r, ROOT, before_aggregate=hook if r == 1 else None)
        if r == 1:
            tolerance = BACKEND_TOLERANCE.get(name, DEFAULT_BACKEND_TOLERANCE)
            assert_trees_close((s, store.state), (s_r, store_r.state), **tolerance)
    # a fixed cohort compiles one round program, in round 1, and never again (persistent-cache hits count too:
    # they are traced)
    assert traced == [1, 0, 0, 0, 0, 0], traced
    # each trained client's real samples of the round (the CLI logs them as train_samples)
    assert np.asarray(m["seen"]).shape == (len(COUNTS),) and np.all(np.asarray(m["seen"]) > 0), m["seen"]
    ev = Evaluator(alg, ragged(test), eval_batch_size=8, preprocess=make_trainer().preprocess,
                   train=ragged(data)).metrics(s, store)
    assert ev["accuracy"].shape == (3,) and np.all(np.isfinite(ev["loss"]))
    # chance is 0.25; every method reaches >= 0.92 after 6 rounds here but the tiny hypernetwork ViT of
    # FedTP, which learns more slowly (0.77)
    assert float(np.mean(ev["accuracy"])) >= (0.5 if name == "fedtp" else 0.75), ev["accuracy"]
    if REGISTRY[name].options.poisson_sampling:  # --cohort-sampling poisson may pad its cohort
        assert_padding_rows_are_absent(alg, seen["server"], seen["trained"], (s_r, store_r.state))


# FedTP's hypernetwork gradient is the cohort's W_qkv updates pulled back through it, and its momentum holds two
# rounds of them: the lane plan's program moved a trunk kernel's momentum 1.2x as far as 16 input nudges did
LANE_TOLERANCE_FACTOR = {"fedtp": 32.0}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_algorithm_runs_the_same_rounds_under_a_lane_plan(name):
    # a lane plan (the clients sorted by local steps, the 2-step client in a chunk of its own, the two 3-step
    # ones in a vmap of two lanes, the rows put back in cohort order) against one vmap over the cohort, where
    # every lane runs to the longest client: the same two rounds up to float32 rounding (another program), the
    # same per-client metrics in the same order, and less padded work
    from jaxfl.core.lanes import LanePlan
    alg, _, server, clients = setup(name)
    data = make_separable(COUNTS)
    plan = LanePlan(((1, 1), (2, 1)), rows=len(COUNTS), batch_size=8)

    plain, planned = (make_backend(alg, data, "stacked", num_rounds=T, **kw)
                      for kw in (dict(lane_segments=0), dict(lane_plan=plan)))
    assert plain.lanes is None and planned.lanes == plan
    s0, c0, _, m0 = engine_rounds(plain, server, clients, ROOT)
    s1, c1, _, m1 = engine_rounds(planned, server, clients, ROOT)
    server_tol, client_tol, loss_tol = rounding_tolerance(lambda s, c: engine_rounds(plain, s, c, ROOT)[:3], server,
                                                          clients, factor=LANE_TOLERANCE_FACTOR.get(name, 16.0),
                                                          draws=3)
    assert_trees_close((s1, c1), (s0, c0), atol=(server_tol, client_tol), rtol=0)
    for a, b, tol in zip(m0, m1, loss_tol):
        np.testing.assert_array_equal(b["client_id"], a["client_id"])
        np.testing.assert_array_equal(b["steps"], a["steps"])
        np.testing.assert_allclose(b["loss"], a["loss"], atol=tol, rtol=0)
        assert b["padded_work"] < a["padded_work"], (a["padded_work"], b["padded_work"])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_algorithm_evaluates_the_same_with_smaller_last_test_batches(name):
    # an evaluation under map computes a client's partial last test batch at the smallest of 2, 4, 8 that holds it
    # (``make_evaluate``'s tail_sizes): a prediction depends on its own input only, so the per-client means are
    # the same up to float rounding; test sets of 24, 17, 9 samples at B = 8 have last batches of 1 real sample
    alg, data, server, clients = setup(name)
    test = make_separable(COUNTS, m=24, seed=1)
    preprocess = make_trainer().preprocess

    def evaluate(sizes):
        fn = make_evaluate(alg, eval_batch_size=8, clients="map", preprocess=preprocess, tail_sizes=sizes)
        return jax.jit(lambda s, c: fn(s, c, test, train=data))
    full, tails = evaluate(()), evaluate(tail_sizes(8))
    want, got = full(server, clients), tails(server, clients)
    tol = rounding_tolerance(full, server, clients)
    assert_trees_close(got, want, atol=tol, rtol=0)
    np.testing.assert_array_equal(got["count"], np.array(COUNTS))
    # the smaller batches did run (a switch more), except where the prediction draws random numbers (FedSR's
    # sampled representation: its draws take the batch's shape), which keeps every batch at B
    switches = [list(jaxpr_primitives(jax.make_jaxpr(f)(server, clients).jaxpr)).count("cond") for f in (full, tails)]
    assert (switches[1] > switches[0]) == (name != "fedsr"), switches


def assert_padding_rows_are_absent(alg, server, trained, want, pad=5):
    """The padded step's aggregate of round 1 (the three clients' trained rows, then rows of count 0 and id N
    holding garbage that ``drop_padding`` must remove) gives what the round gave without them (``want``: the
    server state and the clients' kept states). Jitted: one compilation costs less than the eager ops of an
    aggregate (pFedHN's 20 hypernetwork steps: 7.9 s eager, 1.4 s jitted)."""
    n = len(COUNTS)
    garbage = jax.tree_util.tree_map(
        lambda a: jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], jnp.nan if a.dtype.kind == "f" else 7,
                                               a.dtype)]), trained)
    counts = jnp.concatenate([jnp.asarray(COUNTS, jnp.int32), jnp.zeros(pad, jnp.int32)])
    ids = jnp.concatenate([jnp.arange(n, dtype=jnp.int32), jnp.full(pad, n, jnp.int32)])
    aggregate = jax.jit(make_step(alg, num_rounds=T, padded=True).aggregate)
    new, kept = aggregate(server, garbage, counts, ids, 1)
    # the round's own program against this one: equal up to float32 rounding of the aggregate (FedTP's Adam step
    # on the hypernetwork divides by a small second moment: 1.3e-6 on an AMD EPYC, within 1e-6 on a Xeon)
    unpadded = jax.jit(make_step(alg, num_rounds=T).aggregate)
    tol = rounding_tolerance(unpadded, server, trained,
                             jnp.asarray(COUNTS, jnp.int32), jnp.arange(n, dtype=jnp.int32), 1)
    assert_trees_close((new, jax.tree_util.tree_map(lambda a: a[:n], kept)), want, atol=tol, rtol=0)
