"""The ragged backend's bucket shapes, fixed for a run (``buckets.BucketGrid``): every client of a cohort in one
call of a class that holds its steps, at most ``max_classes`` shapes over any number of cohorts, and a run that
compiles that many bucket programs at most with the stacked backend's numbers."""
import jax
import numpy as np
import pytest
from conftest import make_trainer, traces

from jaxfl.algorithms import build_algorithm
from jaxfl.core.backends import Ragged
from jaxfl.core.buckets import BucketGrid, bucket_grid, grid_ceil, grid_ceil_array, padded_work, plan_buckets
from jaxfl.data.ragged import RaggedClients
from jaxfl.models import logreg


def lognormal_steps(n, sigma=0.8, median=60, batch=10, seed=0):
    counts = np.maximum(1, np.round(np.exp(np.random.default_rng(seed).normal(np.log(median), sigma, n))))
    return counts.astype(np.int64), -(-counts.astype(np.int64) // batch)


def test_grid_ceil_array_is_grid_ceil_elementwise():
    n = np.arange(0, 3000)
    np.testing.assert_array_equal(grid_ceil_array(n), [grid_ceil(int(v)) for v in n])


@pytest.mark.parametrize("cohort,multiple", [(10, 1), (100, 1), (100, 4), (1000, 2)])
def test_every_client_runs_once_in_a_class_that_holds_it_and_shapes_stay_fixed(cohort, multiple):
    _, steps = lognormal_steps(3000)
    grid = bucket_grid(steps, cohort, max_lanes=cohort, lane_multiple=multiple)
    lengths = [length for length, _ in grid.classes]
    assert len(grid.classes) <= 8 and lengths == sorted(set(lengths)) and lengths[-1] == grid_ceil(steps.max())
    assert all(lanes % multiple == 0 and 0 < lanes <= -(-cohort // multiple) * multiple for _, lanes in grid.classes)
    rng, shapes = np.random.default_rng(1), set()
    for _ in range(50):
        ids = rng.choice(len(steps), cohort, replace=False)
        plan = grid.plan(steps[ids])
        placed = np.concatenate([b.positions[b.positions >= 0] for b in plan])
        np.testing.assert_array_equal(np.sort(placed), np.arange(cohort))  # each client exactly once
        for b in plan:
            assert (b.steps, b.lanes) in grid.classes
            assert steps[ids][b.positions[b.positions >= 0]].max() <= b.steps
        shapes |= {(b.steps, b.lanes) for b in plan}
    assert shapes <= set(grid.classes)


def test_the_grid_pads_little_more_than_planning_each_cohort():
    # log-normal sizes (sigma 0.8), cohort 100 of 3,000: a fixed grid of 8 classes computes at most ~15% more
    # lane-steps than buckets planned for each cohort, which need one shape per lanes x grid length
    counts, steps = lognormal_steps(3000)
    grid = bucket_grid(steps, 100, max_lanes=100)
    rng, fixed, greedy, shapes = np.random.default_rng(2), [], [], set()
    for _ in range(40):
        ids = rng.choice(3000, 100, replace=False)
        greedy_plan = plan_buckets(steps[ids], max_lanes=100)
        shapes |= {(b.lanes, b.steps) for b in greedy_plan}
        for plan, out in ((grid.plan(steps[ids]), fixed), (greedy_plan, greedy)):
            done, real = padded_work(plan, counts[ids], 10, per_client_trips=False)
            out.append(done / real)
    assert np.mean(fixed) <= 1.15 * np.mean(greedy) and np.mean(fixed) < 1.4
    assert len(shapes) > 3 * len(grid.classes)


def test_a_class_full_of_clients_spills_to_the_next_and_the_longest_class_takes_the_rest():
    grid = BucketGrid(((2, 2), (8, 1)))
    plan = grid.plan(np.array([1, 2, 1, 7]))  # three clients of <= 2 steps for 2 lanes: the longest spills
    assert [(b.steps, b.lanes) for b in plan] == [(8, 1), (8, 1), (2, 2)]
    assert [b.positions.tolist() for b in plan] == [[3], [1], [0, 2]]
    # a class holding clients for two full calls runs both; the longest class runs every client left
    plan = grid.plan(np.array([1, 2, 1, 2, 7, 5]))
    assert [(b.steps, b.lanes) for b in plan] == [(8, 1), (8, 1), (2, 2), (2, 2)]
    assert sorted(np.concatenate([b.positions for b in plan]).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="exceeds"):
        grid.plan(np.array([9]))


def test_a_ragged_run_compiles_at_most_one_bucket_program_per_class():
    counts, _ = lognormal_steps(60, median=20, batch=4, seed=3)
    rng = np.random.default_rng(0)
    data = RaggedClients.from_clients([(rng.integers(0, 256, (int(n), 4, 4, 1), dtype=np.uint8),
                                        rng.integers(0, 4, int(n)).astype(np.int32)) for n in counts])
    alg = build_algorithm("fedavg", logreg(4), make_trainer(batch_size=4))
    engine = Ragged(alg, data, batch_size=4, num_rounds=12, clients="vmap", cohort_size=12)
    server, store = engine.init(jax.random.key(0), data.x[:1])
    with traces() as traced:
        for r in range(12):
            server, m = engine.round(server, store, r, jax.random.key(1))
    classes = len(engine.grid.classes)
    assert m["compiled_shapes"] <= classes
    assert len([t for t in traced if "train_into" in t]) == m["compiled_shapes"]
