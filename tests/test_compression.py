"""``jaxfl.ops.compression``: each codec against its definition (exact where it is deterministic, unbiased over
keys where it is random), the bit counts, the Walsh-Hadamard rotation, the composition into FedAvg and the CLI."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_cli_runs, info, setup_algorithm, trained_rows

from jaxfl.errors import ConfigError
from jaxfl.models import logreg
from jaxfl.ops import compression as C

D = 37


def vector(seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=D), jnp.float32)


def test_parse_fills_defaults_and_names_what_is_wrong():
    assert C.parse_compression("quantize") == ("quantize", {"bits": 4, "rotate": 0, "feedback": 0})
    assert C.parse_compression("topk:fraction=0.05,feedback=1") == ("topk", {"fraction": 0.05, "feedback": 1})
    for spec, message in [("zip", "'zip' is not one of none, topk"), ("topk:k=3", "'k=3' is not a parameter of topk"),
                          ("topk:fraction=0", "fraction=0 must be a number in (0, 1]"),
                          ("quantize:bits=0", "bits=0 must be an integer in [1, 16]"),
                          ("quantize:rotate=2", "rotate=2 must be 0 or 1")]:
        with pytest.raises(ConfigError) as err:
            C.parse_compression(spec)
        assert message in str(err.value), (spec, str(err.value))


def test_deterministic_codecs_are_their_definitions():
    v = np.asarray(vector())
    got = np.asarray(jax.jit(lambda v: C.topk(v, 0.1))(v))
    k = math.ceil(0.1 * D)
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    want = np.zeros(D, np.float32)
    want[keep] = v[keep]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(C.sign_compress(v), np.abs(v).mean() * np.sign(v), rtol=1e-6)
    # the orthonormal Walsh-Hadamard transform: H / sqrt(n) against the Sylvester matrix, and its own inverse
    h = np.array([[1.0]])
    while len(h) < 8:
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(1).normal(size=8).astype(np.float32)
    np.testing.assert_allclose(C.walsh_hadamard(jnp.asarray(x)), h @ x / np.sqrt(8), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(C.walsh_hadamard(C.walsh_hadamard(jnp.asarray(x))), x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,params", [("randk", {"fraction": 0.25}), ("quantize", {"bits": 2, "rotate": 0}),
                                         ("quantize", {"bits": 2, "rotate": 1}), ("qsgd", {"levels": 2})])
def test_random_codecs_are_unbiased_and_on_their_grid(name, params):
    v = vector(2)
    keys = jax.random.split(jax.random.key(0), 4000)
    out = jax.jit(jax.vmap(lambda k: C.decode(name, v, k, jax.random.key(7), **params)))(keys)
    # E v̂ = v: the mean of 4,000 draws within 5 standard errors of v, coordinate by coordinate
    se = np.asarray(out.std(0)) / np.sqrt(len(keys))
    assert np.all(np.abs(np.asarray(out.mean(0)) - np.asarray(v)) <= 5 * se + 1e-5)
    one = np.asarray(out[0])
    if name == "randk":  # k coordinates, each v_j D / k
        nz = np.flatnonzero(one)
        assert len(nz) == math.ceil(0.25 * D)
        np.testing.assert_allclose(one[nz], np.asarray(v)[nz] * D / len(nz), rtol=1e-5)
    elif name == "quantize" and not params["rotate"]:  # 2^b levels from min to max
        lo, hi = float(v.min()), float(v.max())
        steps = (one - lo) / (hi - lo) * 3
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    elif name == "qsgd":  # ||v|| sign(v) xi / s, xi an integer <= s
        xi = np.abs(one) * 2 / float(jnp.linalg.norm(v))
        np.testing.assert_allclose(xi, np.round(xi), atol=1e-4)
        assert np.all(np.sign(one[one != 0]) == np.sign(np.asarray(v)[one != 0]))


def test_message_bits():
    assert C.message_bits("none", 100) == 3200
    assert C.message_bits("topk", 1000, fraction=0.01) == 10 * (32 + 10)
    assert C.message_bits("randk", 1000, fraction=0.1) == 3200
    assert C.message_bits("quantize", 1000, bits=4, rotate=0) == 4064
    assert C.message_bits("quantize", 1000, bits=4, rotate=1) == 4 * 1024 + 64
    assert C.message_bits("qsgd", 1000, levels=16) == 1000 * 6 + 32
    assert C.message_bits("sign", 1000) == 1032


def test_fedavg_aggregates_the_decoded_updates():
    alg, data, server, clients = setup_algorithm("fedavg", logreg(4), [8, 8, 8, 8])
    trained = trained_rows(alg, data, server, clients, jax.random.key(1))
    weights, ids = jnp.ones(4), jnp.arange(4)
    x = server["params"]
    got = C.with_compression(alg, "topk", jax.random.key(0), fraction=0.2).aggregate(
        server, trained, weights, info(0, ids))[0]["params"]
    leaves, treedef = jax.tree_util.tree_flatten(x)
    rows = jax.tree_util.tree_leaves(trained["params"])
    flat = jnp.concatenate([(r - a[None]).reshape(4, -1) for r, a in zip(rows, leaves)], axis=1)
    dec = jax.vmap(lambda v: C.topk(v, 0.2))(flat)
    start, decoded = 0, []
    for r, a in zip(rows, leaves):
        decoded.append(a[None] + dec[:, start:start + a.size].reshape(r.shape))
        start += a.size
    want = alg.aggregate(server, {**trained, "params": jax.tree_util.tree_unflatten(treedef, decoded)}, weights,
                         info(0, ids))[0]["params"]
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


def test_the_cli_logs_upload_bits_and_refuses_what_does_not_compose(tmp_path, capsys):
    from jaxfl.run.cli import main
    assert_cli_runs("fedavg", tmp_path, "--compression", "qsgd:levels=4")
    rec = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][-1]
    bits = rec["train_upload_bits"]
    assert len(set(bits)) == 1 and bits[0] < 32 * 1e6
    base = ["run", "--quiet", "--rounds", "1", "--out", str(tmp_path / "x")]
    for extra, message in [(["--algorithm", "fedselect", "--compression", "sign"],
                            "fedselect's aggregate is not a mean of shared parameters alone; update compression"),
                           (["--compression", "topk", "--dp-clip", "1", "--weighting", "uniform"], "with --dp-clip")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jaxfl: error:") and message in err[0], err
    assert not (tmp_path / "x").exists()


def test_error_feedback_keeps_the_residual_of_each_present_client():
    # sent_i = Δ_i + e_i, decoded C(sent_i); a present client keeps e_i <- sent_i - C(sent_i), an absent one
    # (weight 0) its old residual; the aggregate is the algorithm's on x + C(sent_i)
    from jaxfl.core.step import init_state
    alg, data, server, _ = setup_algorithm("fedavg", logreg(4), [8, 8, 8, 8])
    ef = C.with_compression(alg, "topk", jax.random.key(0), fraction=0.1, feedback=1)
    server, clients = init_state(ef, jax.random.key(0), data.x[0], 4)
    assert clients["residual"].shape == (4, sum(a.size for a in jax.tree_util.tree_leaves(server["params"])))
    old = jnp.asarray(np.random.default_rng(3).normal(size=clients["residual"].shape), jnp.float32)
    rows = trained_rows(alg, data, server, clients["inner"], jax.random.key(1))
    trained = {**rows, "compression_residual": old}
    weights, ids = jnp.asarray([1.0, 1.0, 0.0, 1.0]), jnp.arange(4)
    new_server, kept = ef.aggregate(server, trained, weights, info(0, ids))
    leaves = jax.tree_util.tree_leaves(server["params"])
    flat = jnp.concatenate([(r - a[None]).reshape(4, -1) for r, a in
                            zip(jax.tree_util.tree_leaves(rows["params"]), leaves)], axis=1)
    sent = flat + old
    dec = jax.vmap(lambda v: C.topk(v, 0.1))(sent)
    np.testing.assert_allclose(kept["residual"][np.array([0, 1, 3])], (sent - dec)[np.array([0, 1, 3])], atol=1e-6)
    np.testing.assert_array_equal(kept["residual"][2], old[2])
    start, decoded = 0, []
    for r, a in zip(jax.tree_util.tree_leaves(rows["params"]), leaves):
        decoded.append(a[None] + dec[:, start:start + a.size].reshape(r.shape))
        start += a.size
    want = alg.aggregate(server, {**rows, "params": jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(server["params"]), decoded)}, weights, info(0, ids))[0]["params"]
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                           new_server["params"], want)


@pytest.mark.parametrize("backend", ["stacked", "ragged"])
def test_error_feedback_runs_on_both_backends_with_a_personal_state(backend):
    # FedBN keeps its BatchNorm leaves; with feedback its state is {"inner": those, "residual": e}
    from conftest import run_rounds
    from jaxfl.core.step import init_state
    from jaxfl.models import small_cnn
    alg, data, _, _ = setup_algorithm("fedbn", small_cnn(4), [8, 12, 8, 10])
    ef = C.with_compression(alg, "sign", jax.random.key(0), feedback=1)
    server, clients = init_state(ef, jax.random.key(0), data.x[0], 4)
    server, clients, metrics = run_rounds(ef, data, server, clients, jax.random.key(2), rounds=2, backend=backend)
    assert np.all(np.isfinite(np.asarray(metrics["loss"])))
    assert set(clients) == {"inner", "residual"} and float(jnp.abs(clients["residual"]).sum()) > 0
    bn = jax.tree_util.tree_leaves(clients["inner"])
    assert bn and all(np.all(np.isfinite(np.asarray(b))) for b in bn)


@pytest.mark.parametrize("name,params", [("randk", {"fraction": 0.1}), ("qsgd", {"levels": 4}),
                                         ("qsgd", {"levels": 16})])
def test_an_unbiased_codec_scaled_by_one_over_one_plus_its_variance_is_contractive(name, params):
    # E||C(v) - v||^2 <= ω ||v||^2 (unbiased_variance), and C / (1 + ω) satisfies error feedback's
    # E||C'(v) - v||^2 <= (1 - 1 / (1 + ω)) ||v||^2; randk's variance is exactly ω ||v||^2
    d = 200
    v = jnp.asarray(np.random.default_rng(0).standard_t(3, size=d), jnp.float32)  # heavy-tailed entries
    omega = C.unbiased_variance(name, d, **params)
    out = jax.vmap(lambda k: C.decode(name, v, k, None, **params))(jax.random.split(jax.random.key(1), 4000))
    norm2 = float(jnp.sum(v ** 2))
    err = float(jnp.mean(jnp.sum((out - v) ** 2, axis=1)))
    # Monte Carlo over 4000 draws: a relative standard error of a few percent
    assert err <= 1.1 * omega * norm2, (err / norm2, omega)
    if name == "randk":
        assert err == pytest.approx(omega * norm2, rel=0.1)
    scaled = float(jnp.mean(jnp.sum((out / (1 + omega) - v) ** 2, axis=1)))
    assert scaled <= 1.02 * (1 - 1 / (1 + omega)) * norm2
    assert C.unbiased_variance("topk", d, fraction=0.1) is None and C.unbiased_variance("quantize", d, bits=4,
                                                                                          rotate=0) is None


def test_error_feedback_sends_randk_unscaled_and_its_residual_stays_bounded():
    # under feedback randk's decoded update is the kept coordinates of Δ + e as they are (C / (1 + ω) with
    # ω = D/k - 1); unscaled by D/k, the residual on them would be (1 - D/k)(Δ + e) and grow round after round
    from jaxfl.core.step import init_state
    alg, data, server, _ = setup_algorithm("fedavg", logreg(4), [8, 8, 8, 8])
    ef = C.with_compression(alg, "randk", jax.random.key(0), fraction=0.25, feedback=1)
    server, clients = init_state(ef, jax.random.key(0), data.x[0], 4)
    rows = trained_rows(alg, data, server, clients["inner"], jax.random.key(1))
    weights, ids = jnp.ones(4), jnp.arange(4)
    _, kept = ef.aggregate(server, {**rows, "compression_residual": clients["residual"]}, weights, info(0, ids))
    leaves = jax.tree_util.tree_leaves(server["params"])
    flat = jnp.concatenate([(r - a[None]).reshape(4, -1) for r, a in
                            zip(jax.tree_util.tree_leaves(rows["params"]), leaves)], axis=1)
    res = np.asarray(kept["residual"])
    # each coordinate is either sent whole (residual 0) or kept whole (residual = Δ_j)
    whole = np.isclose(res, 0, atol=1e-7) | np.isclose(res, np.asarray(flat), rtol=1e-6, atol=1e-7)
    assert whole.all() and np.isclose(res, 0, atol=1e-7).mean() == pytest.approx(0.25, abs=0.02)
