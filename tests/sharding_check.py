"""Run by test_sharding.py in a fresh process with 4 virtual CPU devices: rounds and evaluation with the client
axis sharded over 1, 2 and 4 devices must equal the unsharded run. Prints one line per case; exits 1 on a
mismatch."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import make_data, make_trainer  # noqa: E402
from jaxfl import build_algorithm, init_state, make_evaluate, make_round  # noqa: E402
from jaxfl.distributed import client_mesh, replicate, shard_clients  # noqa: E402
from jaxfl.models import small_cnn  # noqa: E402

COUNTS = [24, 17, 9, 20]
assert jax.device_count() == 4, jax.devices()


def run(name, strategy, mesh=None, rounds=2, cohort=None):
    data = make_data(COUNTS)
    alg = build_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer())
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
    if mesh is not None:
        server, clients, data = replicate(server, mesh), shard_clients(clients, mesh), shard_clients(data, mesh)
    fn = jax.jit(make_round(alg, strategy=strategy, mesh=mesh, cohort_size=cohort, num_rounds=rounds))
    for r in range(rounds):
        server, clients, metrics = fn(server, clients, data, r, jax.random.key(1))
    ev = jax.jit(make_evaluate(alg, eval_batch_size=8, strategy=strategy, mesh=mesh))(server, clients, data)
    if mesh is not None:  # the client rows really live on the mesh's devices
        for leaf in jax.tree_util.tree_leaves((clients, data))[:1]:  # fedavg keeps no client state
            assert len(leaf.sharding.device_set) == mesh.devices.size, leaf.sharding
    return jax.device_get((server, clients, metrics["loss"], ev["accuracy"]))


failed = False
for name, strategy, meshes in (("fedavg", "vmap", (2,)), ("fedavg", "map", (2, 4)), ("fedbn", "map", (2,)),
                               ("fedselect", "map", (2,))):
    ref = run(name, strategy)
    for n in meshes:
        out = run(name, strategy, client_mesh(n))
        ok = all(np.allclose(a, b, atol=1e-5, rtol=1e-5)
                 for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(out)))
        failed |= not ok
        print(f"{name} {strategy} devices={n}: {'equal' if ok else 'DIFFERENT'}", flush=True)
# partial participation: a cohort of 2 of the 4 clients, split over 2 devices
ref, out = run("fedavg", "map", cohort=2), run("fedavg", "map", client_mesh(2), cohort=2)
ok = all(np.allclose(a, b, atol=1e-5) for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(out)))
failed |= not ok
print(f"fedavg cohort=2 devices=2: {'equal' if ok else 'DIFFERENT'}")
# the runner with --devices 2 (mesh over 2 devices) equals the unsharded runner
from jaxfl.config import RunConfig  # noqa: E402
from jaxfl.runner import Experiment  # noqa: E402
tiny = dict(algorithm="fedbn", rounds=2, model="small_cnn", samples_per_client=40, test_per_client=20, clients_per_domain=2,
            batch_size=16)
a = Experiment(RunConfig(**tiny)).run()
for strategy in ("map", "vmap"):  # vmap: buckets whose lanes are multiples of the 2 devices
    b = Experiment(RunConfig(devices=2, strategy=strategy, **tiny)).run()
    ok = np.allclose(a.history[-1]["test_accuracy"], b.history[-1]["test_accuracy"]) and all(
        np.allclose(x, y, atol=1e-5) for x, y in zip(jax.tree_util.tree_leaves(a.clients),
                                                     jax.tree_util.tree_leaves(b.clients)))
    failed |= not ok
    print(f"runner devices=2 {strategy}: {'equal' if ok else 'DIFFERENT'}")
sys.exit(1 if failed else 0)
