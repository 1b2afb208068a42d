"""``jaxfl.ops.attacks`` against NumPy transcriptions of each attack's definition (absent rows, NaN included,
never read), composed into an averaging algorithm, and the CLI path (``--attack``, ``--malicious``)."""
import json
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_cli_runs, info, setup_algorithm, trained_rows

from jaxfl.errors import ConfigError
from jaxfl.models import logreg
from jaxfl.ops.attacks import (ATTACKS, alie_z, attacked_updates, flip_labels, malicious_clients, parse_attack,
                               with_update_attack)


def test_parse_fills_defaults_and_names_what_is_wrong():
    assert parse_attack("none") == ("none", {})
    assert parse_attack("scale") == ("scale", {"scale": 10.0})
    assert parse_attack("ipm:eps=2") == ("ipm", {"eps": 2.0})
    for spec, message in [("flood", "'flood' is not one of none, sign_flip"),
                          ("gaussian:scale=1", "'scale=1' is not a parameter of gaussian (its parameters: std;"),
                          ("gaussian:std=0", "std=0 must be a number > 0"),
                          ("alie:z=-1", "z=-1 must be a number >= 0"), ("ipm:eps=x", "eps=x must be a number > 0")]:
        with pytest.raises(ConfigError) as err:
            parse_attack(spec)
        assert message in str(err.value), (spec, str(err.value))


def test_malicious_clients_are_a_fixed_fraction_drawn_from_the_seed():
    a, b, c = malicious_clients(50, 0.3, 0), malicious_clients(50, 0.3, 0), malicious_clients(50, 0.3, 1)
    assert a.sum() == 15 and np.array_equal(a, b) and not np.array_equal(a, c)
    assert malicious_clients(10, 0.0, 0).sum() == 0
    np.testing.assert_array_equal(flip_labels(np.arange(10), 10), np.arange(9, -1, -1))


def _cohort(seed=0, k=7, d=5):
    rng = np.random.default_rng(seed)
    deltas = rng.normal(size=(k, d)).astype(np.float32)
    deltas[-1] = np.nan  # an absent row holds garbage
    malicious = np.array([1, 0, 0, 1, 0, 0, 1], bool)[:k]
    present = np.arange(k) < k - 1
    return deltas, malicious, present


@pytest.mark.parametrize("name", ["sign_flip", "scale", "gaussian", "alie", "ipm"])
def test_attacked_updates_follow_their_definitions(name):
    deltas, malicious, present = _cohort()
    params = dict(ATTACKS[name])
    got = np.asarray(jax.jit(lambda d: attacked_updates(name, d, jnp.asarray(malicious), jnp.asarray(present),
                                                        jax.random.key(3), **params))(deltas))
    bad, benign = malicious & present, present & ~malicious
    np.testing.assert_array_equal(got[~bad & present], deltas[~bad & present])  # honest rows untouched
    mu, sd = deltas[benign].mean(0), deltas[benign].std(0)
    k, m = present.sum(), bad.sum()
    want = {"sign_flip": -deltas[bad], "scale": 10.0 * deltas[bad],
            "alie": np.broadcast_to(mu - NormalDist().inv_cdf((k - (np.floor(k / 2 + 1) - m)) / k) * sd,
                                    deltas[bad].shape),
            "ipm": np.broadcast_to(-0.5 * mu, deltas[bad].shape)}
    if name == "gaussian":  # pure noise of the given std, nothing of the attacker's update
        assert np.all(np.isfinite(got[bad])) and not np.allclose(got[bad], deltas[bad])
        assert abs(np.std(np.asarray(attacked_updates(name, jnp.zeros((4000, 5)), jnp.ones(4000, bool),
                                                      jnp.ones(4000, bool), jax.random.key(0), std=2.0))) - 2) < 0.05
    else:
        np.testing.assert_allclose(got[bad], want[name], rtol=1e-5, atol=1e-6)
    assert float(alie_z(jnp.float32(50), jnp.float32(12))) == pytest.approx(NormalDist().inv_cdf((50 - 14) / 50),
                                                                            abs=1e-4)


def test_an_update_attack_reaches_the_aggregate_only_through_malicious_rows():
    alg, data, server, clients = setup_algorithm("fedavg", logreg(4), [8, 8, 8, 8, 8, 8])
    trained = trained_rows(alg, data, server, clients, jax.random.key(1))
    weights, ids = jnp.ones(6), jnp.arange(6)
    x = server["params"]
    malicious = np.zeros(12, bool)
    malicious[[1, 4]] = True
    attacked = with_update_attack(alg, "scale", malicious, jax.random.key(0), scale=-3.0)
    got = attacked.aggregate(server, trained, weights, info(0, ids))[0]["params"]
    scaled = jax.tree_util.tree_map(
        lambda t, a: t.at[jnp.array([1, 4])].set(a + -3.0 * (t[jnp.array([1, 4])] - a)), trained["params"], x)
    want = alg.aggregate(server, {**trained, "params": scaled}, weights, info(0, ids))[0]["params"]
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    # a cohort without a malicious client is aggregated as without the attack
    honest = jnp.asarray([0, 2, 3, 5, 6, 7])
    same = attacked.aggregate(server, trained, weights, info(0, honest))[0]["params"]
    own = alg.aggregate(server, trained, weights, info(0, honest))[0]["params"]
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), same, own)


def test_the_cli_runs_attacks_and_refuses_half_given_ones(tmp_path, capsys):
    from jaxfl.run.cli import main
    assert_cli_runs("fedavg", tmp_path, "--attack", "sign_flip", "--malicious", "0.5", "--aggregator", "median",
                    "--clients-per-domain", "2")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    bad = summary["attack"]["malicious_clients"]
    assert summary["attack"]["attack"] == "sign_flip" and len(bad) == round(0.5 * len(summary["clients"])) > 0
    assert set(bad) <= set(summary["clients"])
    base = ["run", "--quiet", "--rounds", "1", "--out", str(tmp_path / "x")]
    for extra, message in [(["--malicious", "0.2"], "--malicious 0.2: malicious clients need an --attack"),
                           (["--attack", "alie"], "--attack alie: give the fraction of malicious clients"),
                           (["--attack", "ipm", "--malicious", "1.5"], "malicious=1.5: give the fraction"),
                           (["--algorithm", "fedselect", "--attack", "alie", "--malicious", "0.2"],
                            "fedselect's aggregate is not a mean of shared parameters alone; update attacks")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jaxfl: error:") and message in err[0], err
    assert not (tmp_path / "x").exists()


def test_label_flipping_changes_only_the_malicious_clients_labels(tmp_path):
    from jaxfl.run.config import RunConfig
    from jaxfl.run.runner import Experiment
    cfg = dict(algorithm="fedselect", dataset="default", model="small_cnn", image_size=12, samples_per_client=20,
               test_per_client=10, rounds=1)
    clean = Experiment(RunConfig(**cfg))
    flipped = Experiment(RunConfig(**cfg, attack="label_flip", malicious=0.5))
    bad = flipped.malicious
    assert bad.sum() == round(0.5 * len(bad))
    for i in range(len(bad)):
        rows = slice(clean.train_data.offsets[i], clean.train_data.offsets[i] + clean.train_data.counts[i])
        want = flip_labels(clean.train_data.y[rows], clean.dataset.num_classes) if bad[i] else clean.train_data.y[rows]
        np.testing.assert_array_equal(flipped.train_data.y[rows], want)
    np.testing.assert_array_equal(flipped.test_data.y, clean.test_data.y)


def test_backdoor_triggers_a_share_of_the_samples_and_its_test_set_excludes_the_target():
    from jaxfl.ops.attacks import add_trigger, backdoor_samples, backdoor_test
    rng = np.random.default_rng(0)
    x = rng.integers(0, 200, (20, 8, 8, 1)).astype(np.uint8)
    y = rng.integers(0, 4, 20).astype(np.int32)
    trig = add_trigger(x, 3)
    assert np.all(trig[:, -3:, -3:, :] == 255) and np.array_equal(trig[:, :5], x[:, :5]) and np.all(x < 255)
    floats = np.asarray(add_trigger(jnp.asarray(x, jnp.float32) / 255, 2))
    assert np.array_equal(floats[:, -2:, -2:], np.ones((20, 2, 2, 1)))
    bx, by = backdoor_samples(x, y, 3, 0.5, 3, np.random.default_rng(1))
    changed = np.flatnonzero(np.any(bx != x, axis=(1, 2, 3)))
    assert len(changed) == 10 and np.all(by[changed] == 3)
    np.testing.assert_array_equal(np.delete(by, changed), np.delete(y, changed))
    tx, ty = backdoor_test(x, y, 3, 3)
    assert len(ty) == int((y != 3).sum()) and np.all(ty == 3) and np.all(tx[:, -3:, -3:] == 255)
    assert parse_attack("backdoor:target=7,size=4") == ("backdoor", {"target": 7, "fraction": 0.5, "size": 4})
    with pytest.raises(ConfigError, match="size=0.5 must be an integer >= 1"):
        parse_attack("backdoor:size=0.5")


def test_a_backdoor_run_reports_its_success_rate(tmp_path):
    from jaxfl.run.cli import main
    assert main(["run", "--quiet", "--algorithm", "fedavg", "--rounds", "2", "--out", str(tmp_path / "r"),
                 "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size", "16",
                 "--test-per-client", "30", "--attack", "backdoor:target=1", "--malicious", "0.5"]) == 0
    rec = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["backdoor_accuracy"] <= 1.0 for r in rec)
