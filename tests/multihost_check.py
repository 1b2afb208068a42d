"""Run by test_multihost.py: one process of a ``num_processes``-process run on localhost (1 CPU device each),
or the one-process reference (num_processes = 1, no sharding). Trains tiny runs through the runner, with
checkpoints, and saves the final states and metrics (gathered from all processes) to an .npz.

    python multihost_check.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
"""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxfl.core import distributed  # noqa: E402
from jaxfl.run.config import RunConfig  # noqa: E402
from jaxfl.run.runner import Experiment  # noqa: E402

pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
distributed.initialize(f"localhost:{port}", nproc, pid)
assert jax.process_count() == nproc and jax.local_device_count() == 1
TINY = dict(rounds=2, model="small_cnn", samples_per_client=40, test_per_client=20, clients_per_domain=2,
            batch_size=16, devices=0 if nproc > 1 else 1)
arrays = {}
for name, extra in (("fedbn", {}), ("fedavg", {"clients_per_round": 2})):
    run_dir = os.path.join(out, f"{name}_{nproc}")
    experiment = Experiment(RunConfig(algorithm=name, out=run_dir, checkpoint_every=1, **TINY, **extra))
    result = experiment.run()
    report = experiment.reliability(result.server, result.clients, jax.random.key(3))
    for key in ("accuracy", "ece", "uncertainty_noisy", "auroc_noisy", "auroc_other"):
        arrays[f"{name}/reliability_{key}"] = np.array(report[key])
    if nproc > 1:  # each call's lanes are split: this process places only its own devices' rows
        rows = distributed.process_rows(Experiment(RunConfig(algorithm=name, **TINY, **extra)).mesh, 4)
        assert rows.tolist() == list(range(2 * pid, 2 * pid + 2)), rows
        # the per-client store lives on every process's host, whole (FedAvg's is empty)
        leaves = jax.tree_util.tree_leaves(result.clients)
        assert all(isinstance(a, np.ndarray) and a.shape[0] == len(result.client_names) for a in leaves) and (
            (name == "fedavg") == (not leaves))
    state = distributed.fetch((result.server, result.clients))
    for i, leaf in enumerate(jax.tree_util.tree_leaves(state)):
        arrays[f"{name}/state{i}"] = np.asarray(leaf)
    for key in ("train_loss", "test_accuracy", "test_loss"):
        arrays[f"{name}/{key}"] = np.array([h[key] for h in result.history])
if pid == 0:
    np.savez(os.path.join(out, f"result_{nproc}.npz"), **arrays)
print(f"process {pid} of {nproc}: done", flush=True)
