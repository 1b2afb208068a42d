"""What a round costs on each data backend, for choosing between them on an accelerator (host-side, no run).

The two backends trade padding for host work. ``Stacked`` keeps the population on the device and runs the
cohort as one call whose lanes all step until the cohort's longest client is done (under ``vmap``);
``Ragged`` keeps the data on the host, gathers each bucket of similar clients there, sends it to the device and
runs the buckets one after another. A round's time on an accelerator is modelled as

    T = E * sum over calls (L lanes, S steps) of S * (tau + L * B * f / P)  +  M / W,

with E local epochs, B the batch size, f the model's training FLOPs per sample (``train_flops_per_sample``),
P the device's achieved FLOP/s, tau the fixed cost of one sequential local step (its kernel launches: a step of
few lanes cannot fill the device), and M the bytes the ragged backend sends per round (each bucket's inputs,
padded to its step grid) over W, the host path's bytes/s (M = 0 for stacked). Stacked is one call of C lanes
and the cohort's longest client's steps; ragged is its ``bucket_grid``'s buckets, each running to its own
longest client. Under ``map`` every client runs its own steps in both, so stacked saves the transfers;
``Chunked(size)`` runs chunks of ``size`` lanes (in cohort order for stacked, by size for ragged). The
constants below were fitted on rounds whose buckets were planned per cohort (``plan_buckets``: one shape per
lanes x grid length; ``per_cohort=True`` models them), which make about as many calls a round as the fixed
grid (simulated, log-normal sizes with sigma 0.8-1, cohorts of 100-1,000: 9.6-14.2 calls against 8.7-13.1).

``H200`` holds one H200's constants (``benchmarks/RESULTS.md``, "The last GPU-suite workloads, and the automatic
backend choice checked on the GPU"; ``benchmarks/backend_model.py``):
W = 2 GB/s, measured apart (the ragged backend's host gathers and transfers: 178 MB in 0.089 s of host time,
logreg at cohort 1,000); tau = 0.2 ms and P = 10 TFLOP/s, the point of a grid (tau 0-1 ms, P 5-40 TFLOP/s)
that picks the faster backend on the most of the ten stacked/ragged pairs measured there (logreg, 2NN, FEMNIST
CNN, character LSTM, FedAvg CNN; synthetic and MNIST clients; cohorts 10-1,000), then has the least squared
log error in round time. It picks right on all ten; so does the same choice made without each pair in turn (it
lands on the same point every time). P is an effective rate, below the 16-25 TFLOP/s of the stacked CNN and
LSTM rounds: it also absorbs the time of memory-bound work. With tau = 0 the model gets the FedAvg CNN at
cohort 10 wrong (one stacked call's padded lanes cost less than the ragged backend's extra sequential steps).
On a CPU the data never leaves the host, so the rule does not apply there.

A run also compiles its programs once: the stacked backend one round program, the ragged backend one per bucket
class of its ``bucket_grid`` (at most 8). ``run_seconds`` weighs them against the run's length,

    T_run = R * T + n * c,

R rounds of T seconds, n round or bucket programs of c seconds each (c = ``DeviceRates.compile_s``), so a short
run keeps the backend that compiles less even where the other one's rounds are faster. ``H200``'s c = 2.5 s: on
the four MNIST workloads of ``benchmarks/backend_choice.py`` (8 rounds each backend, no compile cache), the
ragged run's extra compile seconds over the stacked run's, divided by its extra bucket programs (the shapes its
per-cohort buckets took, simulated from the same clients: ``benchmarks/backend_model.py``), were 1.6 s (logreg),
2.2 s (2NN), 3.0 s and 5.0 s (FedAvg CNN at cohorts 10 and 100); c is the median, within 2x of each.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .buckets import BucketGrid, bucket_grid, grid_ceil_array, plan_buckets
from .cohort import Chunked, ClientMap, Map, client_map


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """An accelerator's rates for the round-time model (see the module docstring)."""
    flops_per_s: float = 1e13  # P: achieved training FLOP/s (an effective rate: see the module docstring)
    step_s: float = 2e-4  # tau: the fixed cost of one sequential local step
    host_bytes_per_s: float = 2e9  # W: the ragged backend's host gathers and transfers
    compile_s: float = 2.5  # c: compiling one round or bucket program


H200 = DeviceRates()


def train_flops_per_sample(model, sample_x, batch_size: int, preprocess=lambda x: x) -> float:
    """XLA's FLOP count of one gradient of sum(model(preprocess(x))^2) (train mode) over a batch of
    ``batch_size`` inputs shaped like the rows of ``sample_x``, per sample. Lowered from abstract shapes only,
    for the CPU whatever the default device (a GPU plugin's ``Lowered.cost_analysis()`` returns None, which
    read as 0 FLOPs made every GPU run pick the stacked backend): nothing is compiled or run. Raises
    ValueError if XLA reports no FLOP count."""
    with jax.default_device(_cpu_device()):  # unsharded abstract inputs lower for the default device
        raw = jax.ShapeDtypeStruct((batch_size,) + tuple(sample_x.shape[1:]), sample_x.dtype)
        x = _abstract(jax.eval_shape(preprocess, raw))
        variables = _abstract(jax.eval_shape(lambda k, x: model.init(k, x, False), jax.random.key(0), x))
        rest = {k: v for k, v in variables.items() if k != "params"}

        def total(params, rest, x):
            y, _ = model.apply({**rest, "params": params}, x, True, mutable=list(rest),  # (output, updated state)
                               rngs={"dropout": jax.random.key(0)})  # train mode: dropout layers draw
            return jnp.sum(jnp.square(y))  # nonlinear in y, so the backward pass needs the forward one

        cost = jax.jit(jax.grad(total)).lower(variables["params"], rest, x).cost_analysis() or {}
    flops = float(cost.get("flops", 0.0))
    if not flops > 0:
        raise ValueError(f"XLA reports no FLOP count for {type(model).__name__}'s training step: {cost}")
    return flops / batch_size


def _cpu_device():
    """A CPU device, or None (the default device) where jax runs without its CPU platform."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # e.g. JAX_PLATFORMS=cuda
        return None


def _abstract(tree):
    """The tree's ShapeDtypeStructs without shardings (a sharding would pin the lowering to its device)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


# The most lane-steps ``lane_overhead`` returns. On one H200 (benchmarks/RESULTS.md, library at b65f0a4; 1,000
# log-normal clients, sigma 0.8, cohort 1,000) a plan at 32 lanes of overhead ran the 2NN 3.2x and logistic
# regression 1.1x faster than one vmap over the cohort, which is what the uncapped ratio (~230 and ~6,200 lanes)
# approaches: the model's tau and P leave out the per-lane memory traffic of small models, so past a few tens of
# lanes it overrates a step's fixed cost. A model of >= ~1 GFLOP a step (B f) stays below the cap.
MAX_LANE_OVERHEAD = 32.0


def lane_overhead(flops_per_sample: float, batch_size: int, rates: DeviceRates = H200,
                  cap: float = MAX_LANE_OVERHEAD) -> float:
    """A local step's fixed cost in lane-steps, for ``lanes.plan_lanes``: min(tau P / (B f), cap), the launch
    latency of one sequential step over the compute of one lane's step (tau / (B f / P)), at most ``cap``
    (``MAX_LANE_OVERHEAD``: measured, see there). E.g. on the H200 constants the FEMNIST CNN at B = 10 (~103
    MFLOP a sample): ~1.9 lanes; the 2NN (~0.9 MFLOP): ~230, capped to 32."""
    return min(rates.step_s * rates.flops_per_s / (batch_size * flops_per_sample), cap)


def _max_lanes(clients: ClientMap, n: int) -> int:
    """A call's most lanes for ``n`` clients: a chunk's size under ``Chunked``, else all ``n``."""
    return clients.size if isinstance(clients, Chunked) else n


def stacked_calls(steps, clients: ClientMap | str) -> list[tuple[int, int]]:
    """The (lanes, sequential steps) of the stacked backend's calls for a cohort of per-client step counts
    ``steps`` [C] (cohort order) run by ``clients`` (a ``ClientMap`` or its name): vmap, one call of C lanes
    running to the longest client; map, every client its own steps one after another; chunked, chunks of its
    size in cohort order."""
    clients = client_map(clients)
    steps = [int(s) for s in steps]
    if isinstance(clients, Map):
        return [(1, s) for s in steps]
    size = _max_lanes(clients, max(len(steps), 1))
    return [(len(steps[i:i + size]), max(steps[i:i + size])) for i in range(0, len(steps), size)]


def ragged_calls(steps, clients: ClientMap | str, *, grid: BucketGrid | None = None,
                 per_cohort: bool = False) -> tuple[list[tuple[int, int]], int]:
    """The ragged backend's calls for the same cohort, and the sample slots it sends to the device: (list of
    (lanes, sequential steps), lanes x grid steps summed over buckets). Buckets come from ``grid``, the backend's
    ``bucket_grid`` for the population (``ragged_grid``; default: the cohort's own), or ``plan_buckets``' one
    bucket under map; a bucket's lanes step until its longest real
    client is done, and its data is padded to its class length. ``per_cohort``: ``plan_buckets``' greedy buckets
    of each cohort instead (what the ragged backend ran when the GPU pairs behind ``H200`` were measured)."""
    clients = client_map(clients)
    steps = np.asarray(steps, np.int64)
    single = isinstance(clients, Map)
    if single or per_cohort:
        plan = plan_buckets(steps, max_lanes=max(_max_lanes(clients, len(steps)), 1), single=single)
    else:
        plan = (grid or ragged_grid(steps, len(steps), clients)).plan(steps)
    slots = sum(b.lanes * b.steps for b in plan)
    if single:
        return [(1, int(s)) for s in steps], slots
    return [(b.lanes, int(steps[b.positions[b.positions >= 0]].max())) for b in plan], slots


def ragged_grid(steps, cohort: int, clients: ClientMap | str) -> BucketGrid:
    """The ragged backend's ``bucket_grid`` for a population of per-client step counts ``steps`` [N] and cohorts
    of ``cohort`` clients (at most a chunk's size of lanes a call under ``Chunked``)."""
    return bucket_grid(steps, cohort, max_lanes=max(_max_lanes(client_map(clients), cohort), 1))


def round_seconds(calls, step_flops: float, sent_bytes: float = 0.0, epochs: int = 1,
                  rates: DeviceRates = H200) -> float:
    """E * sum over calls (L, S) of S * (tau + L * step_flops / P) + sent_bytes / W: the modelled time of
    one round; ``step_flops`` = B * f, one lane's local step."""
    compute = sum(s * (rates.step_s + lanes * step_flops / rates.flops_per_s) for lanes, s in calls)
    return epochs * compute + sent_bytes / rates.host_bytes_per_s


def backend_seconds(counts, batch_size: int, cohort: int, flops_per_sample: float, bytes_per_sample: float, *,
                    clients: ClientMap | str, epochs: int = 1, rates: DeviceRates = H200, draws: int = 3,
                    seed: int = 0, per_cohort: bool = False) -> tuple[float, float]:
    """(stacked, ragged): the modelled round seconds of each backend, averaged over ``draws`` cohorts of
    ``cohort`` of the population's clients (``counts`` [N] samples each; fixed draws of ``seed``);
    ``per_cohort``: the ragged buckets as ``ragged_calls(per_cohort=True)`` plans them."""
    counts = np.asarray(counts, np.int64)
    steps = -(-counts // batch_size)
    rng = np.random.default_rng(seed)
    step_flops = batch_size * flops_per_sample
    clients = client_map(clients)
    grid = None if isinstance(clients, Map) or per_cohort else ragged_grid(steps, min(cohort, len(counts)), clients)
    stacked = ragged = 0.0
    for _ in range(draws):
        ids = np.sort(rng.choice(len(counts), size=min(cohort, len(counts)), replace=False))
        stacked += round_seconds(stacked_calls(steps[ids], clients), step_flops, epochs=epochs, rates=rates)
        calls, slots = ragged_calls(steps[ids], clients, grid=grid, per_cohort=per_cohort)
        ragged += round_seconds(calls, step_flops, sent_bytes=slots * batch_size * bytes_per_sample,
                                epochs=epochs, rates=rates)
    return stacked / draws, ragged / draws


def backend_programs(steps, cohort: int, clients: ClientMap | str) -> tuple[int, int]:
    """(stacked, ragged): the round programs each backend compiles in a run over a population of per-client step
    counts ``steps`` [N] with cohorts of ``cohort`` clients: stacked one; ragged one per class of its
    ``ragged_grid`` (under ``map`` one bucket per cohort, padded to the step grid: at most one program per grid
    length of the population's step counts, the count returned)."""
    clients = client_map(clients)
    steps = np.asarray(steps, np.int64)
    if isinstance(clients, Map):
        return 1, len(np.unique(grid_ceil_array(steps)))
    return 1, len(ragged_grid(steps, cohort, clients).classes)


def run_seconds(round_s: float, rounds: int, programs: int, rates: DeviceRates = H200) -> float:
    """R * T + n * c: a run of ``rounds`` rounds of ``round_s`` seconds that compiles ``programs`` round or
    bucket programs of ``rates.compile_s`` seconds each (see the module docstring)."""
    return rounds * round_s + programs * rates.compile_s
