"""FedCP (conditional policy): the gates, the MMD (against a transcription of the official estimator) and the
context by definition, the loss by hand, the server's averages and what the cohort takes back, and the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_cli_runs, assert_trees_close, make_data, make_trainer, rounding_tolerance, run_rounds

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import head_on
from jaxfl.algorithms.fedcp import MMD_BANDWIDTHS, fedcp_loss, head_context, policy_gates, policy_init
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn
from jaxfl.ops.losses import gaussian_mmd

COUNTS = (12, 20, 7)
ROOT = jax.random.key(3)


def model(hidden=()):
    return small_cnn(num_classes=4, width=4, hidden=hidden)


def setup(**options):
    data = make_data(list(COUNTS))
    alg = build_algorithm("fedcp", model(), make_trainer(), RunContext(num_clients=3), **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    return alg, data, server, clients


def official_mmd(x, y):
    """FedCP's clientcp.MMD (kernel 'rbf', bandwidths 10, 15, 20, 50), transcribed in numpy."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    sq = lambda a, b: ((a[:, None] - b[None]) ** 2).sum(-1)  # noqa: E731
    k = lambda d: sum(np.exp(-0.5 * d / a) for a in (10, 15, 20, 50))  # noqa: E731
    return np.mean(k(sq(x, x)) + k(sq(y, y)) - 2 * k(sq(x, y)))


def test_gates_mmd_and_context_follow_their_definitions():
    rng = np.random.default_rng(0)
    d = 6
    cpn = policy_init(jax.random.key(1), d)
    z, c = rng.normal(size=(5, d)).astype(np.float32), rng.uniform(size=d).astype(np.float32)
    pm, gm = jax.jit(policy_gates)(cpn, z, c)
    u = z * c / np.linalg.norm(c)
    h = u @ np.asarray(cpn["dense"]["kernel"]) + np.asarray(cpn["dense"]["bias"])
    h = np.maximum((h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5), 0)
    np.testing.assert_allclose(pm, 1 / (1 + np.exp(-(h[:, :d] - h[:, d:]))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pm) + np.asarray(gm), 1.0, rtol=1e-6)
    noisy, _ = policy_gates(cpn, z, c, jax.random.key(2), 1.0)
    assert not np.allclose(noisy, pm) and float(noisy.min()) > 0 and float(noisy.max()) < 1
    a, b = rng.normal(size=(6, 4)).astype(np.float32), (rng.normal(size=(6, 4)) + 1).astype(np.float32)
    np.testing.assert_allclose(float(gaussian_mmd(a, b, jnp.ones(6), MMD_BANDWIDTHS)), official_mmd(a, b), rtol=1e-4)
    w = jnp.asarray(np.arange(8) < 6, jnp.float32)  # two padded rows change nothing
    pad = lambda m: np.concatenate([m, 50 * np.ones((2, 4), np.float32)])  # noqa: E731
    np.testing.assert_allclose(float(gaussian_mmd(pad(a), pad(b), w, MMD_BANDWIDTHS)), official_mmd(a, b), rtol=1e-4)
    # (sums of terms of both signs: equal up to float32 rounding of the context's computation)
    context = jax.jit(head_context)
    head = model().init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]["head"]
    np.testing.assert_allclose(context(head), np.asarray(head["fc1"]["linear"]["kernel"]).sum(1), rtol=0,
                               atol=rounding_tolerance(context, head))
    deep = model((8,)).init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]["head"]
    k1, k2 = np.asarray(deep["fc1"]["linear"]["kernel"]), np.asarray(deep["fc2"]["linear"]["kernel"])
    np.testing.assert_allclose(context(deep), (k1 @ k2).sum(1), rtol=0, atol=rounding_tolerance(context, deep))


def test_loss_by_hand_and_a_round():
    alg, data, server, clients = setup(lam=2.0)
    m = model()
    c = jax.tree_util.tree_map(lambda a: a[0], clients)
    x, y, w = data.x[0, :8] / 255.0 * 2 - 1, data.y[0, :8], jnp.ones(8)
    enc = jax.tree_util.tree_map(lambda a: a * 1.1, server["encoder"])  # a trained encoder differs from f-bar
    params = {"encoder": enc, "head": c["head"], "cs": c["cs"]}
    loss, _ = fedcp_loss(m, 2.0, 1.0)(params, c["batch_stats"], x, y, w, None, c["head_g"], c["context"],
                                      server["encoder"])
    feats = lambda e: m.apply({"params": {"encoder": e}, "batch_stats": c["batch_stats"]}, x, True, w,  # noqa: E731
                              method="features", mutable=["batch_stats"])[0]
    z, z_bar = feats(enc), feats(server["encoder"])
    pm, gm = policy_gates(c["cs"], z, c["context"])
    head = lambda h, f: m.apply({"params": {"head": h}, "batch_stats": c["batch_stats"]}, f, True, w,  # noqa: E731
                                method=head_on, mutable=["batch_stats"])[0]
    logits = np.asarray(head(c["head"], z * pm) + head(c["head_g"], z * gm), np.float64)
    ce = -np.mean(logits[np.arange(8), np.asarray(y)] - np.log(np.exp(logits).sum(-1)))
    want = ce + 2.0 * official_mmd(np.asarray(z), np.asarray(z_bar))
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    # one round: the server averages encoder, policy and uploaded heads 0.5 h_p + 0.5 h_g; the cohort takes them back
    s1, c1, _, rows = run_rounds(alg, data, server, clients, ROOT, rounds=1, keep_rows=True)
    p = jnp.asarray(COUNTS, jnp.float32) / sum(COUNTS)
    mean = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: jnp.tensordot(p, a, 1), t))
    uploads_mean = jax.jit(lambda h, g: mean(jax.tree_util.tree_map(lambda a, b: 0.5 * a + 0.5 * b, h, g)))
    # (another program than the round's aggregation: equal up to float32 rounding of the weighted means)
    for got, want, tol in [(s1["encoder"], mean(rows["encoder"]), rounding_tolerance(mean, rows["encoder"])),
                           (s1["cs"], mean(rows["cs"]), rounding_tolerance(mean, rows["cs"])),
                           (s1["head_g"], uploads_mean(rows["head"], clients["head_g"]),
                            rounding_tolerance(uploads_mean, rows["head"], clients["head_g"]))]:
        assert_trees_close(got, want, atol=tol, rtol=0)
    for i in range(3):
        assert_trees_close(jax.tree_util.tree_map(lambda a: a[i], c1["head_g"]), s1["head_g"], atol=0, rtol=0)
    assert_trees_close(c1["head"], rows["head"], atol=0, rtol=0)
    contexts = jax.jit(jax.vmap(head_context))  # (another program than the round's: up to float32 rounding)
    np.testing.assert_allclose(c1["context"], contexts(rows["head"]), rtol=0,
                               atol=rounding_tolerance(contexts, rows["head"]))


def test_the_cli_runs_fedcp(tmp_path):
    assert_cli_runs("fedcp", tmp_path)
