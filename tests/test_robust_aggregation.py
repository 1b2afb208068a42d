"""``--aggregator``: the robust rules composed into the averaging algorithms (``jaxfl.ops.robust_aggregation``):
the parsing of NAME:key=value, the new global model x + R(updates) on the shared leaves and the algorithm's own
aggregate elsewhere, absent rows ignored, and the CLI path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_cli_runs, info, rounding_tolerance, setup_algorithm

from jaxfl.ops.robust_aggregation import (AGGREGATORS, RULES, parse_aggregator, robust_params, robust_rule,
                                           with_robust_aggregate)
from jaxfl.errors import ConfigError
from jaxfl.models import logreg, small_cnn
from jaxfl.ops import robust


def test_parse_fills_defaults_and_names_what_is_wrong():
    assert parse_aggregator("mean") == ("mean", {})
    assert parse_aggregator("trimmed_mean") == ("trimmed_mean", {"beta": 0.1})
    assert parse_aggregator("multi_krum:f=2, m=3") == ("multi_krum", {"f": 2, "m": 3})
    assert parse_aggregator("centered_clip:tau=0.5") == ("centered_clip", {"tau": 0.5, "iters": 1})
    for spec, message in [("nosuch", "'nosuch' is not one of mean, median"),
                          ("krum:g=1", "'g=1' is not a parameter of krum (its parameters: f;"),
                          ("median:f=1", "(its parameters: none;"),
                          ("trimmed_mean:beta=0.5", "beta=0.5 must be a number in [0, 0.5)"),
                          ("krum:f=-1", "f=-1 must be an integer >= 0"), ("krum:f=1.5", "f=1.5 must be an integer"),
                          ("norm_bound:bound=0", "bound=0 must be a number > 0"), ("krum:f", "'f' is not")]:
        with pytest.raises(ConfigError) as err:
            parse_aggregator(spec)
        assert message in str(err.value), (spec, str(err.value))
    assert set(AGGREGATORS) == {"mean", *RULES}


def _rows(seed=0, k=6):
    """server params x (logreg leaves), trained rows x + Δ_i [k], an outlier row and a padding row of NaN."""
    rng = np.random.default_rng(seed)
    model = logreg(3)
    x = model.init(jax.random.key(seed), jnp.zeros((1, 4, 4, 1)))["params"]
    deltas = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=(k,) + a.shape), a.dtype) * 0.1, x)
    deltas = jax.tree_util.tree_map(lambda d: d.at[k - 2].set(40.0).at[k - 1].set(jnp.nan), deltas)
    trained = jax.tree_util.tree_map(lambda a, d: a[None] + d, x, deltas)
    weights = jnp.asarray([1.0, 2.0, 1.0, 3.0, 1.0, 0.0])[:k]
    return x, trained, deltas, weights


@pytest.mark.parametrize("name", list(RULES))
def test_robust_params_is_x_plus_the_rule_over_the_present_updates(name):
    # all leaves shared: x + R(flattened Δ over the present rows), the padding row's NaN nowhere, under jit
    x, trained, deltas, weights = _rows()
    rule = robust_rule(name, **RULES[name])
    mean = jax.tree_util.tree_map(lambda a: a * 0 - 7.0, x)  # the algorithm's own aggregate (unused here)
    shared = jax.tree_util.tree_map(lambda _: True, x)
    fn = jax.jit(lambda t, w: robust_params(rule, x, t, mean, shared, w))
    got = fn(trained, weights)
    flat = jnp.concatenate([d.reshape(len(weights), -1) for d in jax.tree_util.tree_leaves(deltas)], axis=1)
    step = rule(flat, weights > 0, weights)
    want = jnp.concatenate([a.reshape(-1) for a in jax.tree_util.tree_leaves(x)]) + step
    got_flat = jnp.concatenate([a.reshape(-1) for a in jax.tree_util.tree_leaves(got)])
    assert np.all(np.isfinite(got_flat))
    tol = jax.tree_util.tree_leaves(rounding_tolerance(fn, trained, weights))
    np.testing.assert_allclose(got_flat, want, rtol=0, atol=max(float(t) for t in tol))


def test_unshared_leaves_keep_the_mean_and_take_no_part():
    # the bias is personal (Python False): it keeps the algorithm's aggregate, and its huge updates do not
    # move Krum's choice; a traced False keeps the mean too
    x, trained, deltas, weights = _rows(1)
    mean = jax.tree_util.tree_map(lambda a: a + 3.0, x)
    trained["head"]["fc1"]["linear"]["bias"] = trained["head"]["fc1"]["linear"]["bias"].at[0].set(1e6)
    shared = {"head": {"fc1": {"linear": {"kernel": True, "bias": False}}}}
    rule = robust_rule("krum", f=1)
    got = robust_params(rule, x, trained, mean, shared, weights)
    np.testing.assert_array_equal(got["head"]["fc1"]["linear"]["bias"], mean["head"]["fc1"]["linear"]["bias"])
    k = deltas["head"]["fc1"]["linear"]["kernel"]
    choice = robust.multi_krum(k.reshape(len(weights), -1), weights > 0, 1, 1)[0]
    np.testing.assert_allclose(got["head"]["fc1"]["linear"]["kernel"],
                               x["head"]["fc1"]["linear"]["kernel"] + choice.reshape(k.shape[1:]), atol=1e-6)
    traced = jax.jit(lambda s: robust_params(rule, x, trained, mean, {"head": {"fc1": {"linear": {
        "kernel": True, "bias": s}}}}, weights))(jnp.asarray(False))
    np.testing.assert_array_equal(traced["head"]["fc1"]["linear"]["bias"], mean["head"]["fc1"]["linear"]["bias"])


def test_fedavg_with_krum_drops_an_outlier_the_mean_follows():
    # one client's update scaled by 100 (a model-replacement attacker): the mean moves far, Krum does not;
    # with identical honest updates every rule but norm_bound returns the mean of the honest ones
    alg, data, server, clients = setup_algorithm("fedavg", logreg(4), [8, 8, 8, 8, 8])
    from conftest import trained_rows
    trained = trained_rows(alg, data, server, clients, jax.random.key(1))
    x = server["params"]
    attacked = {**trained, "params": jax.tree_util.tree_map(
        lambda t, a: t.at[4].set(a + 100.0 * (t[4] - a)), trained["params"], x)}
    weights = jnp.full(5, 1.0)
    i = info(0, jnp.arange(5))
    mean = alg.aggregate(server, attacked, weights, i)[0]["params"]
    krum = with_robust_aggregate(alg, "krum", f=1).aggregate(server, attacked, weights, i)[0]["params"]
    dist = lambda a: float(sum(jnp.sum((p - q) ** 2) for p, q in zip(jax.tree_util.tree_leaves(a),  # noqa: E731
                                                                     jax.tree_util.tree_leaves(x))))
    honest = max(dist(jax.tree_util.tree_map(lambda t: t[j], trained["params"])) for j in range(4))
    assert dist(krum) <= honest * (1 + 1e-5) and dist(mean) > 100 * honest
    same = {**trained, "params": jax.tree_util.tree_map(lambda t: jnp.broadcast_to(t[:1], t.shape),
                                                        trained["params"])}
    for name in ("median", "trimmed_mean", "krum", "multi_krum", "geometric_median", "centered_clip"):
        params = dict(RULES[name], **({"tau": 1e6} if name == "centered_clip" else {}))
        got = with_robust_aggregate(alg, name, **params).aggregate(server, same, weights, i)[0]["params"]
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b[0], rtol=0, atol=1e-5), got,
                               same["params"])


def test_fedbn_keeps_its_batchnorm_layers_local_under_a_robust_rule():
    alg, data, server, clients = setup_algorithm("fedbn", small_cnn(4), [8, 8, 8, 8])
    from conftest import trained_rows
    trained = trained_rows(alg, data, server, clients, jax.random.key(2))
    weights, i = jnp.ones(4), info(0, jnp.arange(4))
    own, own_kept = alg.aggregate(server, trained, weights, i)
    med, med_kept = with_robust_aggregate(alg, "median").aggregate(server, trained, weights, i)
    bn = lambda p: p["encoder"]["bn1"]  # noqa: E731
    jax.tree_util.tree_map(np.testing.assert_array_equal, bn(med["params"]), bn(own["params"]))
    jax.tree_util.tree_map(np.testing.assert_array_equal, med_kept, own_kept)
    conv = np.asarray(med["params"]["encoder"]["conv1"]["kernel"])
    want = np.asarray(server["params"]["encoder"]["conv1"]["kernel"]) + np.median(
        np.asarray(trained["params"]["encoder"]["conv1"]["kernel"] - server["params"]["encoder"]["conv1"]["kernel"]),
        axis=0)
    np.testing.assert_allclose(conv, want, rtol=0, atol=1e-6)


def test_the_cli_runs_a_robust_aggregator_and_refuses_what_does_not_compose(tmp_path, capsys):
    from jaxfl.run.cli import main
    assert_cli_runs("fedavg", tmp_path, "--aggregator", "trimmed_mean:beta=0.2")
    base = ["run", "--quiet", "--rounds", "1", "--out", str(tmp_path / "x")]
    for extra, message in [(["--algorithm", "fedselect", "--aggregator", "median"],
                            "fedselect's aggregate is not a mean of shared parameters alone"),
                           (["--algorithm", "fedavg", "--aggregator", "krum:f=x"], "f=x must be an integer >= 0"),
                           (["--algorithm", "fedavg", "--aggregator", "median", "--dp-clip", "1", "--weighting",
                             "uniform"], "with --dp-clip")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jaxfl: error:") and message in err[0], err
    assert not (tmp_path / "x").exists()
