"""Run by test_sharding.py in a fresh process with 4 virtual CPU devices: rounds and evaluation with the client
axis sharded over 1, 2 and 4 devices must equal the unsharded run. Prints one line per case; exits 1 on a
mismatch."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import make_backend, make_data, make_trainer, ragged  # noqa: E402
from jaxfl.algorithms import build_algorithm  # noqa: E402
from jaxfl.core.cohort import Map, client_map  # noqa: E402
from jaxfl.core.distributed import client_mesh  # noqa: E402
from jaxfl.core.evaluate import Evaluator  # noqa: E402
from jaxfl.models import small_cnn  # noqa: E402

COUNTS = [24, 17, 9, 20]
assert jax.device_count() == 4, jax.devices()


def run(name, strategy, mesh=None, rounds=2, cohort=None, backend="stacked", epochs=1, stragglers=0.0, **kw):
    data = make_data(COUNTS)
    alg = build_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer(epochs=epochs))
    clients = client_map(strategy, mesh=mesh)  # (the client axis split over mesh; None: one device)
    engine = make_backend(alg, data, backend, clients=clients, cohort_size=cohort, num_rounds=rounds,
                          stragglers=stragglers, **kw)
    if "lane_plan" in kw:  # (the plan given is the one the rounds run)
        assert engine.lanes == kw["lane_plan"], engine.lanes
    server, store = engine.init(jax.random.key(0), data.x[0])
    for r in range(rounds):
        server, metrics = engine.round(server, store, r, jax.random.key(1))
    ev = Evaluator(alg, ragged(data), eval_batch_size=8, preprocess=make_trainer().preprocess,
                   clients=clients).metrics(server, store)
    return jax.device_get((server, store.state, metrics["loss"], ev["accuracy"]))


failed = False
# (FedBN: personal state (BatchNorm) on both backends against one reference; each case compiles its own programs,
# so the list is what the mesh changes: vmap and map, the three backends, 2 and 4 devices, kept states)
for name, strategy, meshes, backends in (("fedavg", "vmap", (2,), ("stacked", "streamed")),
                                         ("fedavg", "map", (2, 4), ("ragged",)),
                                         ("fedbn", "map", (2,), ("stacked", "streamed", "ragged"))):
    ref = run(name, strategy)
    for n in meshes:
        for backend in backends:
            out = run(name, strategy, client_mesh(n), backend=backend)
            ok = all(np.allclose(a, b, atol=1e-5, rtol=1e-5)
                     for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(out)))
            failed |= not ok
            print(f"{name} {strategy} {backend} devices={n}: {'equal' if ok else 'DIFFERENT'}", flush=True)
# a lane plan over 2 devices (each device sorts its 2 rows by local steps and runs them as two 1-lane chunks) against
# one vmap on one device, with personal states (FedBN) and stragglers (each client's own epochs)
from jaxfl.core.lanes import LanePlan  # noqa: E402
ref = run("fedbn", "vmap", epochs=2, stragglers=0.5, lane_segments=0)
out = run("fedbn", "vmap", client_mesh(2), epochs=2, stragglers=0.5,
          lane_plan=LanePlan(((1, 1), (1, 1)), rows=2, batch_size=8))
ok = all(np.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(jax.tree_util.tree_leaves(ref),
                                                                  jax.tree_util.tree_leaves(out)))
failed |= not ok
print(f"fedbn vmap stacked lane plan devices=2: {'equal' if ok else 'DIFFERENT'}", flush=True)
# over a mesh the rows are ordered for the devices (device_balanced_order: here [0, 2, 1, 3], steps 3, 3, 2, 3);
# the per-client metrics above came back in cohort order, and so do the rows a round's hook sees (the personal
# models right after local training), with their ids, on a full and on a Poisson cohort
def hooked(mesh, backend, **kw):
    data = make_data(COUNTS)
    alg = build_algorithm("fedbn", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer())
    engine = make_backend(alg, data, backend, clients=client_map("map", mesh=mesh), num_rounds=2, **kw)
    server, store = engine.init(jax.random.key(0), data.x[0])
    seen = []

    def hook(server, trained, ids):
        seen.append((jax.device_get(trained), np.asarray(ids)))

    for r in range(2):
        server, metrics = engine.round(server, store, r, jax.random.key(1), before_aggregate=hook)
    return seen, jax.device_get((server, store.state, metrics["loss"], metrics["client_id"]))


for backend in ("stacked", "streamed"):
    for kw in ({}, dict(sampling="poisson", cohort_size=2)):
        (seen_ref, ref), (seen, out) = (hooked(mesh, backend, **kw) for mesh in (None, client_mesh(2)))
        ok = all(np.array_equal(a[1], b[1]) for a, b in zip(seen_ref, seen)) and all(
            np.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in zip(jax.tree_util.tree_leaves((seen_ref, ref)),
                                                                     jax.tree_util.tree_leaves((seen, out))))
        failed |= not ok
        print(f"{backend} {kw.get('sampling', 'fixed')} hook rows devices=2: {'equal' if ok else 'DIFFERENT'}",
              flush=True)
# the ragged backend's map bucket over 2 devices: each device's half of the lanes gets its share of the steps
# (sorted longest first, the first half would hold the two long clients: 11 steps against 4)
steps = np.array([5, 1, 1, 1, 4, 1, 1, 1])
engine = make_backend(build_algorithm("fedavg", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer()),
                      make_data(list(steps * 8)), "ragged", clients=Map(mesh=client_mesh(2)))
[bucket] = engine.plan(np.arange(8))
halves = steps[bucket.positions].reshape(2, -1).sum(1)
ok = sorted(bucket.positions) == list(range(8)) and sorted(halves) == [7, 8]
failed |= not ok
print(f"ragged map bucket balanced over devices=2: {'equal' if ok else 'DIFFERENT ' + str(halves)}", flush=True)
# the stacked backend places the population (samples and states) once on every device of the mesh, and the
# states stay there round after round (an array on one device would be copied to the others in every round)
data = make_data(COUNTS)
engine = make_backend(build_algorithm("fedbn", small_cnn(num_classes=4, width=4, hidden=(8,)), make_trainer()), data,
                      "stacked", clients=Map(mesh=client_mesh(2)))
server, store = engine.init(jax.random.key(0), data.x[0])
for r in range(2):
    server, _ = engine.round(server, store, r, jax.random.key(1))
placed = [a.sharding for a in jax.tree_util.tree_leaves((engine.data, store.state))]
ok = bool(jax.tree_util.tree_leaves(store.state)) and all(
    p.is_fully_replicated and len(p.device_set) == 2 for p in placed)
failed |= not ok
print(f"stacked population on both devices: {'equal' if ok else 'DIFFERENT ' + str(placed)}")
# partial participation (a cohort of 2 of the 4 clients) with stragglers (each client's own draw), split over 2
# devices
ref, out = (run("fedavg", "map", mesh, cohort=2, epochs=3, stragglers=0.5) for mesh in (None, client_mesh(2)))
ok = all(np.allclose(a, b, atol=1e-5) for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(out)))
failed |= not ok
print(f"fedavg cohort=2 stragglers=0.5 devices=2: {'equal' if ok else 'DIFFERENT'}")
# the runner with --devices 2 (mesh over 2 devices) equals the unsharded runner
from jaxfl.run.config import RunConfig  # noqa: E402
from jaxfl.run.runner import Experiment  # noqa: E402
tiny = dict(algorithm="fedbn", rounds=2, model="small_cnn", samples_per_client=40, test_per_client=20,
            clients_per_domain=2, batch_size=16)
a = Experiment(RunConfig(**tiny)).run()
for strategy, backend in (("map", None), ("map", "ragged")):  # (vmap on a mesh: the first case above)
    exp = Experiment(RunConfig(devices=2, strategy=strategy, backend=backend, **tiny))
    b = exp.run()
    # equal clients: the stacked backend unless asked for ragged, on the mesh as without one
    ok = exp.backend_name == (backend or "stacked") and np.allclose(
        a.history[-1]["test_accuracy"], b.history[-1]["test_accuracy"]) and all(
        np.allclose(x, y, atol=1e-5) for x, y in zip(jax.tree_util.tree_leaves(a.clients),
                                                     jax.tree_util.tree_leaves(b.clients)))
    failed |= not ok
    print(f"runner devices=2 {strategy} ({exp.backend_name}): {'equal' if ok else 'DIFFERENT'}")
# a Poisson cohort (expected size 3, padded to 8 rows a device) needs no cohort that splits evenly over the devices
poisson = dict(tiny, cohort_sampling="poisson", clients_per_round=3, rounds=3)
a, b = (Experiment(RunConfig(devices=d, **poisson)).run() for d in (1, 2))
ok = [h["clients_trained"] for h in a.history] == [h["clients_trained"] for h in b.history] and np.allclose(
    a.history[-1]["test_accuracy"], b.history[-1]["test_accuracy"]) and all(
    np.allclose(x, y, atol=1e-5) for x, y in zip(jax.tree_util.tree_leaves(a.clients),
                                                 jax.tree_util.tree_leaves(b.clients)))
failed |= not ok
print(f"runner devices=2 poisson cohort of 3 expected: {'equal' if ok else 'DIFFERENT'}")
sys.exit(1 if failed else 0)
