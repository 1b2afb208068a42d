"""Lane plans: the cohort sorted by local steps and run as chunks of vmap lanes inside one call
(``jaxfl.core.lanes``), and the stacked round that uses them."""
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, engine_rounds, make_trainer, rounding_tolerance, traces

from jaxfl.algorithms import build_algorithm
from jaxfl.core.backends import Stacked
from jaxfl.core.cohort import Chunked
from jaxfl.core.lanes import LanePlan, expected_sorted_steps, plan_lanes
from jaxfl.core.types import RunContext
from jaxfl.data.ragged import RaggedClients
from jaxfl.errors import ConfigError
from jaxfl.models import logreg, small_cnn


def test_apply_is_vmap_whatever_the_plan_under_jit():
    # a row's result depends on its own inputs only, in the rows' own order, whatever the segments, chunks,
    # bottom padding and ties in the key
    def fn(a, b):
        return {"sum": jnp.sum(a) * b, "row": a * 2.0}, b + 1

    rng = np.random.default_rng(0)
    a, b = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32), jnp.asarray(rng.integers(0, 9, 7), jnp.int32)
    key = jnp.asarray([3, 1, 4, 1, 5, 9, 2], jnp.float32)
    want = jax.vmap(fn)(a, b)
    for segments in [((7, 1),), ((1, 7),), ((2, 4),), ((4, 1), (2, 1), (1, 1)), ((3, 1), (2, 2))]:
        plan = LanePlan(segments, rows=7, batch_size=4)
        got = jax.jit(lambda k, x, y: plan.apply(fn, k, x, y))(key, a, b)
        jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_apply_runs_each_chunk_to_its_own_longest_row():
    # a while loop of a row's own trip count under vmap runs to its chunk's longest row: counted by a carried
    # counter of iterations that every lane sees (the chunk's trip count)
    def fn(n):
        def body(c):
            i, t = c
            return i + 1, t + 1
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, 0))[1]

    n = jnp.asarray([5, 1, 9, 2, 2, 7, 3, 1], jnp.int32)
    plan = LanePlan(((4, 1), (2, 1), (2, 1)), rows=8, batch_size=1)
    trips = jax.jit(lambda n: plan.apply(lambda m: jax.vmap(fn)(m[None])[0], n.astype(jnp.float32), n))(n)
    np.testing.assert_array_equal(trips, n)  # each row's own count (vmap's select keeps finished lanes)
    # the work a plan computes: chunk ends of the sorted steps [1 1 2 2 | 3 5 | 7 9] -> 4*2 + 2*5 + 2*9
    assert plan.work(np.asarray(n)) == 4 * 2 + 2 * 5 + 2 * 9
    # bottom padding repeats the shortest row: [1 | 1 1 2 | 2 3 5 | 7 9] in chunks of 3 -> 3 * (1 + 3 + 9)
    assert LanePlan(((3, 3),), rows=8, batch_size=1).work(np.asarray(n)) == 3 * (1 + 3 + 9)


def test_apply_gives_each_chunk_its_largest_bound_unbatched():
    # bound [k]: every lane of a chunk gets the chunk's largest value, a scalar (not batched under the vmap)
    n = jnp.asarray([5, 1, 9, 2, 2, 7, 3, 1], jnp.int32)
    plan = LanePlan(((4, 1), (2, 1), (2, 1)), rows=8, batch_size=1)

    def fn(m, bound):
        assert bound.shape == ()
        return bound

    got = jax.jit(lambda n: plan.apply(fn, n.astype(jnp.float32), n, bound=n))(n)
    # sorted [1 1 2 2 | 3 5 | 7 9]: chunk maxima 2, 5, 9, back in the rows' order
    np.testing.assert_array_equal(got, [5, 2, 9, 2, 2, 9, 5, 2])


def _brute_force(e, segments_max, overhead, sizes):
    """The cheapest cost of the plan_lanes model by enumeration (small k only): every cut of ranks 0..k-1 into at
    most ``segments_max`` segments, every lane count of each; a segment above the first holds whole chunks, the
    first may be padded at the bottom."""
    k, best = len(e), float("inf")
    for g in range(1, segments_max + 1):
        for cuts in itertools.combinations(range(1, k), g - 1):
            bounds = (0,) + cuts + (k,)
            for lanes in itertools.product(sizes, repeat=g):
                total = 0.0
                for s, (i, j) in enumerate(zip(bounds, bounds[1:])):
                    if s and (j - i) % lanes[s]:
                        total = float("inf")
                        break
                    total += (overhead + lanes[s]) * e[np.arange(j - 1, i - 1 if s else -1, -lanes[s])].sum()
                best = min(best, total)
    return best


@pytest.mark.parametrize("overhead", [0.0, 0.7, 3.0, 50.0])
def test_plan_lanes_finds_the_cheapest_plan_of_its_model(overhead):
    rng = np.random.default_rng(1)
    e = np.sort(np.ceil(np.exp(rng.normal(1.5, 0.8, 9))))
    sizes = [1, 2, 4, 8]
    plan = plan_lanes(e, batch_size=1, max_segments=3, overhead=overhead, lane_sizes=sizes)
    assert plan.rows == 9 and plan.size - plan.rows < plan.segments[0][0]
    got = sum((overhead + lanes) * e_end for lanes, e_end in _chunk_ends(plan, e))
    assert got == pytest.approx(_brute_force(e, 3, overhead, sizes))


def _chunk_ends(plan, e):
    padded = np.concatenate([np.full(plan.size - len(e), e[0]), e])
    start = 0
    for lanes, chunks in plan.segments:
        for c in range(chunks):
            yield lanes, padded[start + lanes * (c + 1) - 1]
        start += lanes * chunks


def test_plan_lanes_extremes():
    e = np.arange(1.0, 101.0)
    assert plan_lanes(e, batch_size=8, overhead=0.0).segments == ((1, 100),)  # no step cost: every client alone
    assert plan_lanes(np.full(64, 5.0), batch_size=8, overhead=1.0).segments == ((64, 1),)  # equal clients: vmap
    with pytest.raises(ValueError, match="at least one row"):
        plan_lanes([], batch_size=8)
    with pytest.raises(ValueError, match="padding must fit"):
        LanePlan(((4, 3),), rows=5, batch_size=8)


def test_expected_sorted_steps():
    steps = np.array([5, 1, 3, 8])
    np.testing.assert_array_equal(expected_sorted_steps(steps, 4), [1, 3, 5, 8])  # everyone: the population
    e = expected_sorted_steps(steps, 2, members=2, draws=400)
    assert e[0] <= e[1] and e[1] == pytest.approx(np.mean([max(a, b) for a, b in itertools.combinations(steps, 2)]),
                                                  rel=0.1)
    poisson = expected_sorted_steps(steps, 8, rate=0.25, draws=50)  # members last, padding rows (0 steps) first
    assert np.all(np.diff(poisson) >= 0) and poisson[0] == 0 and poisson[-1] > 0


def _population(counts, seed=0):
    rng = np.random.default_rng(seed)
    return RaggedClients.from_clients([(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
                                        rng.integers(0, 4, n).astype(np.int32)) for n in counts])


COUNTS = (24, 3, 17, 9, 40, 1, 30, 12, 5, 22)


def _rounds(alg, data, rounds=2, **kw):
    engine = Stacked(alg, data, batch_size=8, num_rounds=4, **kw)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    server, metrics = engine.run_rounds(server, store, 0, rounds, jax.random.key(5))
    return server, store.state, metrics, engine


def _tolerance(engine, data, rounds=2):
    """``rounding_tolerance`` of ``_rounds``'s run on ``engine`` (its programs, compiled already) from its start,
    as a function of the float states (server, clients): (server, clients, [each round's loss])."""
    server, store = engine.init(jax.random.key(0), data.x[:1])
    return rounding_tolerance(lambda s, c: engine_rounds(engine, s, c, jax.random.key(5), rounds)[:3], server,
                              store.state)


def _against_plain(alg, data, rounds=2, plan=None, **kw):
    """``rounds`` rounds of ``alg`` under a lane plan (``plan``, else the one the backend plans) against one vmap
    over the same rows (``lane_segments=0``), both with the backend options ``kw``: asserts the states agree up to
    float32 rounding of the plain rounds (another program) and each round reports the same clients, in the same
    order, with the same losses. -> (the planned engine, the plain and the planned rounds' metrics, the planned
    server, its tolerance)."""
    s0, c0, m0, plain = _rounds(alg, data, rounds, lane_segments=0, **kw)
    s1, c1, m1, engine = _rounds(alg, data, rounds, **kw, **({} if plan is None else {"lane_plan": plan}))
    assert engine.lanes is not None and (plan is None or engine.lanes == plan), engine.lanes
    server_tol, client_tol, loss_tol = _tolerance(plain, data, rounds)
    assert_trees_close((s1, c1), (s0, c0), atol=(server_tol, client_tol), rtol=0)
    for a, b, tol in zip(m0, m1, loss_tol):
        np.testing.assert_array_equal(a["client_id"], b["client_id"])
        np.testing.assert_allclose(b["loss"], a["loss"], atol=tol, rtol=0)
    return engine, m0, m1, s1, server_tol


@pytest.mark.parametrize("name", ["fedavg", "fedbn", "ditto"])
def test_a_lane_plan_round_is_the_plain_vmap_round(name):
    # sorted chunks of lanes (three segments, bottom padding) against one vmap over the cohort: the same per-client
    # results (their keys and data), aggregated in cohort order; stragglers change the sort key (their epochs)
    alg = build_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(epochs=2),
                          RunContext(num_clients=len(COUNTS), num_rounds=4))
    data = _population(COUNTS)
    plan = LanePlan(((2, 1), (1, 2), (1, 1)), rows=5, batch_size=8)
    _, m0, m1, _, _ = _against_plain(alg, data, plan=plan, clients="vmap", cohort_size=5, stragglers=0.5)
    for a, b in zip(m0, m1):
        np.testing.assert_array_equal(a["steps"], b["steps"])
        assert b["padded_work"] < a["padded_work"]


@pytest.mark.parametrize("level", ["user", "sample"])
def test_a_lane_plan_round_is_the_plain_vmap_round_under_dp(level):
    # DP-FedAvg (each client's update clipped, Gaussian noise on the sum: the server's draw) and DP-SGD (each
    # sample's gradient clipped, noise on every step: the client's own stream) under a lane plan against one vmap:
    # the clipping and the noise follow the clients, not their lanes, so the rounds agree up to float32 rounding
    from jaxfl.core import privacy
    from jaxfl.core.dpsgd import SampleDP
    from jaxfl.core.trainer import ClientOptimizer, LocalTrainer

    def private(z):  # FedAvg with noise multiplier z at the level tested
        dp = SampleDP(1.0, z) if level == "sample" else None
        trainer = LocalTrainer(ClientOptimizer("sgd", 0.05, 0.5), 8, 2, dp=dp)
        alg = build_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), trainer,
                              RunContext(num_clients=len(COUNTS), num_rounds=4))
        return privacy.with_privacy(alg, 0.1, z, jax.random.key(4)) if level == "user" else alg

    data = _population(COUNTS)
    plan = LanePlan(((2, 1), (1, 2), (1, 1)), rows=5, batch_size=8)
    kw = dict(clients="vmap", cohort_size=5)
    _, _, _, s1, server_tol = _against_plain(private(1.0), data, plan=plan, **kw)
    # the noise is there: the same rounds without it end far outside that tolerance
    s2 = _rounds(private(0.0), data, lane_plan=plan, **kw)[0]
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree_util.tree_leaves(s2), jax.tree_util.tree_leaves(s1)))
    assert moved > 100 * max(jax.tree_util.tree_leaves(server_tol)), moved


def test_a_poisson_cohort_under_a_lane_plan_is_the_plain_vmap_round():
    # a Poisson cohort (Binomial(N, q) members, padded to 8 rows with rows of count 0) planned for its rows (the
    # padding rows sort first, as clients of 0 steps) against one vmap over the same rows, with personal states
    alg = build_algorithm("fedbn", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(epochs=2),
                          RunContext(num_clients=len(COUNTS), num_rounds=4))
    engine, m0, m1, _, _ = _against_plain(alg, _population(COUNTS), rounds=3, clients="vmap", sampling="poisson",
                                          cohort_size=4)
    assert engine.lanes.rows == engine.rows, engine.lanes
    for a, b in zip(m0, m1):
        assert b["padded_work"] < a["padded_work"]


def test_the_planned_stacked_round_computes_little_padding_and_rounds_per_call_keep_it_exact():
    rng = np.random.default_rng(3)
    counts = np.maximum(1, np.round(60 * np.exp(0.8 * rng.normal(size=200)))).astype(int)
    data = _population(counts)
    alg = build_algorithm("fedavg", logreg(4), make_trainer(batch_size=10), RunContext(num_clients=200))
    kw = dict(clients="vmap", cohort_size=40)
    _, _, plain, _ = _rounds(alg, data, rounds=3, lane_segments=0, **kw)
    s1, c1, planned, engine = _rounds(alg, data, rounds=3, **kw)
    assert len(engine.lanes.segments) <= 3
    assert np.mean([m["padded_work"] for m in plain]) > 2.5  # one vmap: every lane to the longest client
    assert np.mean([m["padded_work"] for m in planned]) < 1.3
    s4, c4, by4, _ = _rounds(alg, data, rounds=3, rounds_per_call=3, **kw)
    # K rounds per call are K single rounds up to float rounding: XLA:CPU fuses a chunk loop's arithmetic
    # differently in the K = 1 and K = 3 programs (1 ulp in some clients' losses; bit for bit under map, where
    # the tests of resuming with another K run)
    server_tol, client_tol, _ = _tolerance(engine, data, rounds=3)
    assert_trees_close((s4, c4), (s1, c1), atol=(server_tol, client_tol), rtol=0)


def test_chunked_sorts_its_chunks_and_poisson_cohorts_are_planned_for_their_rows():
    data = _population(COUNTS)
    alg = build_algorithm("fedavg", logreg(4), make_trainer(), RunContext(num_clients=len(COUNTS)))
    _, _, m, engine = _rounds(alg, data, clients=Chunked(2), cohort_size=6)
    assert engine.lanes.segments == ((2, 3),)
    _, _, m, engine = _rounds(alg, data, clients="vmap", sampling="poisson", cohort_size=4)
    assert engine.lanes.rows == engine.rows and all(np.all(x["client_id"] < len(COUNTS)) for x in m)


def test_bad_lane_settings_are_refused():
    data = _population(COUNTS)
    alg = build_algorithm("fedavg", logreg(4), make_trainer(), RunContext(num_clients=len(COUNTS)))
    with pytest.raises(ConfigError, match="lane_segments=-1 must be an integer >= 0"):
        Stacked(alg, data, batch_size=8, lane_segments=-1)
    with pytest.raises(ConfigError, match="lane_overhead=-2 must be a number >= 0"):
        Stacked(alg, data, batch_size=8, lane_overhead=-2)
    with pytest.raises(ConfigError, match="lane_plan for 3 rows a device needs fixed cohorts of 3"):
        Stacked(alg, data, batch_size=8, clients="vmap", cohort_size=4,
                lane_plan=LanePlan(((3, 1),), rows=3, batch_size=8))


def test_a_run_with_uneven_clients_picks_the_stacked_backend_and_compiles_its_round_once(data_dir):
    # the CLI's path: --strategy vmap on MNIST split into log-normal client sizes; the automatic choice takes the
    # stacked backend (a lane plan runs the cohort), the first round traces its programs (the round, the
    # evaluation, the cohort draw), later rounds (new cohorts, evaluated too) none, and the plan computes less
    # padding than one vmap over the cohort. Traces, not compilations, are counted: a persistent-cache hit
    # is traced too.
    from jaxfl.run.config import RunConfig
    from jaxfl.run.runner import Experiment
    base = dict(algorithm="fedavg", dataset="mnist", data_dir=data_dir, model="logreg", num_clients=300,
                clients_per_round=100, partition="dirichlet_quantity", client_sizes="lognormal", size_sigma=0.8,
                batch_size=10, lr=0.05, strategy="vmap", rounds=4, eval_every=1)
    exp = Experiment(RunConfig(**base))
    assert exp.backend_name == "stacked" and exp.backend.lanes is not None
    per_round = []
    with traces() as traced:
        history = exp.run(log=lambda record: per_round.append(len(traced))).history
    assert per_round == [len(traced)] * 4, (per_round, traced)  # all in round 1 (and before it)
    assert traced.count("rounds_fn") == 1 and len(traced) <= 12, traced
    assert max(h["padded_work"] for h in history) < 1.3
    plain = Experiment(RunConfig(lane_segments=0, backend="stacked", **base)).run().history
    assert min(h["padded_work"] for h in plain) > 2.0


def test_a_run_under_a_lane_plan_resumes_bit_exactly(data_dir, tmp_path):
    # the CLI's path with a lane plan (--strategy vmap on log-normal MNIST clients, Ditto's personal models kept
    # in the checkpoint): stopped after round 2 and resumed to round 4, the run ends with the uninterrupted run's
    # server, clients and metrics, bit for bit (the plan follows the client sizes and the cohort size, so the
    # resumed run compiles the same programs and replays the same per-client streams)
    from jaxfl.run.config import RunConfig
    from jaxfl.run.runner import Experiment
    base = dict(algorithm="ditto", dataset="mnist", data_dir=data_dir, model="logreg", num_clients=60,
                clients_per_round=20, partition="dirichlet_quantity", client_sizes="lognormal", size_sigma=0.8,
                batch_size=10, lr=0.05, strategy="vmap", eval_every=2)
    full = Experiment(RunConfig(rounds=4, **base))
    assert full.backend_name == "stacked" and full.backend.lanes is not None
    full = full.run()
    first = Experiment(RunConfig(rounds=2, out=str(tmp_path), checkpoint_every=1, **base))
    plan = first.backend.lanes
    first.run()
    resumed = Experiment(RunConfig(rounds=4, out=str(tmp_path), checkpoint_every=1, resume=True, **base))
    assert resumed.backend.lanes == plan
    resumed = resumed.run()
    assert_trees_close((resumed.server, resumed.clients), (full.server, full.clients), atol=0, rtol=0)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3, 4]
    for key in ("train_loss", "test_accuracy", "padded_work"):
        assert lines[-1][key] == full.history[-1][key], key
