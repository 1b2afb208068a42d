"""FedNova: the normalizing vector as the official optimizer accumulates it, the server update against a hand
computation, FedAvg as the reduction (equal step counts), and its run through the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, make_data, make_trainer, rounds_tolerance, run_rounds

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms.fednova import normalized_average, normalizing_norm
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn
from jaxfl.run.cli import main


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_normalizing_norm_is_the_official_step_by_step_accumulation(rho):
    for tau in range(1, 12):
        counter, vec = 0.0, 0.0
        for _ in range(tau):  # FedNova.step: local_counter = rho * counter + 1; vec += counter (rho = 0: vec += 1)
            counter = counter * rho + 1
            vec += counter if rho else 1
        # float32
        np.testing.assert_allclose(float(jax.jit(normalizing_norm, static_argnums=1)(tau, rho)), vec, rtol=1e-5)


def test_server_update_matches_the_formula():
    rng = np.random.default_rng(0)
    w = {"a": rng.normal(size=(3, 2)).astype(np.float32)}
    wi = {"a": rng.normal(size=(4, 3, 2)).astype(np.float32)}
    n, a = np.array([10.0, 30.0, 20.0, 40.0]), np.array([2.0, 6.0, 4.0, 8.0])
    out = jax.jit(normalized_average)(w, wi, jnp.asarray(n), jnp.asarray(a))
    p = n / n.sum()
    tau_eff = (p * a).sum()
    want = w["a"] - sum(p[i] * tau_eff / a[i] * (w["a"] - wi["a"][i]) for i in range(4))
    np.testing.assert_allclose(np.asarray(out["a"]), want, rtol=1e-5, atol=1e-6)
    # a client that took twice the steps moves the model half as much per unit of weight as FedAvg would
    fedavg = (p[:, None, None] * wi["a"]).sum(0)
    assert not np.allclose(np.asarray(out["a"]), fedavg, atol=1e-3)


def test_equal_step_counts_reduce_to_fedavg():
    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    ctx = RunContext(num_clients=3)  # FedNova reads the momentum from the trainer
    data = make_data([16, 16, 16])
    root = jax.random.key(3)
    out = {}
    for name in ("fedavg", "fednova"):
        alg = build_algorithm(name, model, make_trainer(momentum=0.5), ctx)
        server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
        out[name] = run_rounds(alg, data, server, clients, root, rounds=2)[0]
    # two programs for the same math: equal up to float32 rounding of FedAvg's two rounds (alg, server, clients:
    # FedAvg's, the loop's last)
    tol = rounds_tolerance(alg, data, server, clients, root, rounds=2)[0]
    assert_trees_close(out["fednova"], out["fedavg"], atol=tol, rtol=0)


def test_unequal_clients_differ_from_fedavg_and_the_cli_runs_fednova(tmp_path, capsys):
    model = small_cnn(num_classes=4, width=4, hidden=(8,))
    ctx = RunContext(num_clients=3)
    data = make_data([8, 16, 40])  # 1, 2 and 5 steps of batch 8
    outs = {}
    for name in ("fedavg", "fednova"):
        alg = build_algorithm(name, model, make_trainer(momentum=0.0), ctx)
        server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
        outs[name] = run_rounds(alg, data, server, clients, jax.random.key(3), rounds=1)[0]["params"]
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(outs["fedavg"]),
                                                           jax.tree_util.tree_leaves(outs["fednova"])))
    assert gap > 1e-4
    assert main(["run", "--quiet", "--algorithm", "fednova", "--rounds", "2", "--out", str(tmp_path / "r"),
                 "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size", "16",
                 "--test-per-client", "30", "--server-opt", "sgd", "--server-momentum", "0.5"]) == 0
    assert (tmp_path / "r" / "summary.json").is_file()
