import os
from pathlib import Path

# The tests run tiny models, where compiling dominates and XLA:CPU spends most of it in LLVM's optimisation:
# unoptimised code (--xla_backend_optimization_level=0) about halves the compile time. It is set before jax creates
# its CPU backend; subprocess checks (sharding, multihost) inherit it. XLA:CPU's older LLVM IR emitters
# (--xla_cpu_use_fusion_emitters=false) compile faster than its default MLIR fusion emitters, but they round
# differently in different programs: a test that claims two *different* programs agree bit for bit (a reduction
# run as another algorithm, K rounds per call against one) compiles, through ``default_codegen``, with the
# default emitters, the code generator users run, in the same process. JAXFL_TEST_DEFAULT_CODEGEN=1 runs the
# whole suite with the default emitters; JAXFL_TEST_XLA_DEFAULTS=1 adds no XLA flag at all (XLA:CPU as users run
# it: optimised code, default emitters), to check the tolerances against the compiler's own choices on a CPU.
XLA_DEFAULTS = os.environ.get("JAXFL_TEST_XLA_DEFAULTS") == "1"
DEFAULT_CODEGEN = XLA_DEFAULTS or os.environ.get("JAXFL_TEST_DEFAULT_CODEGEN") == "1"
FAST_CODEGEN_FLAG = "--xla_cpu_use_fusion_emitters=false"
if not XLA_DEFAULTS:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               + ("" if DEFAULT_CODEGEN else " " + FAST_CODEGEN_FLAG)).strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as jaxfl/__init__.py sets it (jax is imported first here)
# Many tests build the same jitted round anew (a fresh Experiment, a fresh backend): XLA's persistent cache
# turns the repeated LLVM compilations into a file read, within a worker, across the two xdist workers and in
# the subprocess checks (they inherit the environment). One folder per suite run (PYTEST_XDIST_TESTRUNUID is
# shared by the workers of one run), under the system's temporary folder; never part of the repository.
_run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
# the process that names the folder (pytest's main process; xdist's workers inherit it) removes it at the end
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
CACHE_PREFIX = "jaxfl-test-xla-cache-"  # + the run's id; remove_stale_caches finds earlier runs' folders by it
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(__import__("tempfile").gettempdir(),
                                                                CACHE_PREFIX + _run_id))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import contextlib  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxfl.core.trainer import ClientOptimizer, LocalTrainer
from jaxfl.data.clients import ClientData

# start jax's backends now, with its one CPU device: a run in this process never splits its cohort over the
# cores (which an Experiment built before any other jax work would do), so no test's numbers depend on which
# test a worker ran first. CLI checks in a fresh process split over the cores as users' runs do.
jax.devices()

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


_CODEGEN_CACHES = []


def codegen_cache(fn):
    """``functools.lru_cache(fn)``, emptied whenever ``default_emitters`` switches the code generator: a cached
    *result* (trained states) computed with one generator must not stand in for the other's in a bit-identity
    test. (Cached functions and algorithms need none of this: jax's caches are cleared at the switch.)"""
    cached = functools.lru_cache(maxsize=None)(fn)
    _CODEGEN_CACHES.append(cached)
    return cached


def _clear_compiled():
    jax.clear_caches()
    for cached in _CODEGEN_CACHES:
        cached.cache_clear()


@contextlib.contextmanager
def default_emitters():
    """Within the block, every XLA:CPU compilation uses its default (fusion) emitters: the suite's flag is
    overridden per compilation (``env_option_overrides``, what ``jax.jit(..., compiler_options=...)`` sets), and
    jax's in-memory caches (and ``codegen_cache`` results) are cleared on entry and exit, so that nothing compiled
    with the other emitters is reused inside the block, nor anything of the block's outside it. (The persistent
    cache keys programs by their compile options, these overrides included.) Patches jax's private
    ``compiler.get_compile_options``: if a jax release moves it, the bit-identity tests fail, never pass wrongly."""
    from jax._src import compiler
    make = compiler.get_compile_options

    def with_default_emitters(*args, **kwargs):
        options = make(*args, **kwargs)
        options.env_option_overrides = [*options.env_option_overrides, ("xla_cpu_use_fusion_emitters", True)]
        return options
    _clear_compiled()
    compiler.get_compile_options = with_default_emitters
    try:
        yield
    finally:
        compiler.get_compile_options = make
        _clear_compiled()


def default_codegen(test):
    """Run ``test`` with XLA:CPU's default code generator (see the top of this file, and ``default_emitters``):
    for tests that assert bit-identity between two different compiled programs."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if DEFAULT_CODEGEN:
            return test(*args, **kwargs)
        with default_emitters():
            return test(*args, **kwargs)
    return wrapper


def bit_identity(why: str):
    """Mark a test that compares two *different* programs bit for bit, with ``why`` they are exact (e.g. a
    reduction that adds exact zeros, a leaf copied and never computed, the same round program run in a loop).
    Every other float comparison uses a tolerance derived from the computation (``rounding_tolerance``);
    these run with XLA:CPU's default code generator, the one users run (``default_codegen``).
    ``pytest -m bit_identity`` runs them alone; the reasons are in each test's marker."""
    if not why.strip():
        raise ValueError("bit_identity needs the reason the two programs are exact")

    def mark(test):
        return pytest.mark.bit_identity(why)(default_codegen(test))
    return mark


def pytest_configure(config):
    config.addinivalue_line("markers", "bit_identity(why): compares two different programs bit for bit, because "
                                       "of why (conftest.bit_identity)")
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # pytest's main process: it owns the compile cache
        import signal
        import time
        own = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
        remove_stale_caches(own.parent, own, time.time())
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _stop_as_interrupted)


def make_data(counts, m=None, shape=(8, 8, 3), seed=0, classes=4):
    """Random uint8 client data padded to m (default: max count), labels in [0, classes)."""
    rng = np.random.default_rng(seed)
    m = m or max(counts)
    x = rng.integers(0, 256, (len(counts), m) + shape, dtype=np.uint8)
    y = rng.integers(0, classes, (len(counts), m)).astype(np.int32)
    for i, c in enumerate(counts):  # padding is zeros, as stack_clients writes it
        x[i, c:] = 0
        y[i, c:] = 0
    return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(np.array(counts, np.int32)))


def make_separable(counts, m=None, shape=(8, 8, 3), seed=0, classes=4):
    """Client data of a separable task: noise images (0-59) in which class c lights rows
    [c * H/classes, (c + 1) * H/classes) at 255; padded to m like ``make_data``."""
    rng = np.random.default_rng(seed)
    m = m or max(counts)
    y = rng.integers(0, classes, (len(counts), m)).astype(np.int32)
    x = rng.integers(0, 60, (len(counts), m) + shape).astype(np.uint8)
    rows = shape[0] // classes
    for c in range(classes):
        x[y == c, c * rows:(c + 1) * rows] = 255
    for i, c in enumerate(counts):
        x[i, c:] = 0
        y[i, c:] = 0
    return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(np.array(counts, np.int32)))


def make_trainer(batch_size=8, epochs=1, lr=0.05, momentum=0.5, tail_sizes=None):
    """SGD as the CLI builds it (``ClientOptimizer``: the trainer carries its learning rate and momentum);
    ``tail_sizes``: the sizes a partial last batch may run at (``LocalTrainer.tail_sizes``)."""
    return LocalTrainer(ClientOptimizer("sgd", lr, momentum), batch_size, epochs, tail_sizes=tail_sizes)


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    """Leaf by leaf |a - b| <= atol + rtol |b|; ``atol`` a number or a tree of numbers like ``b``
    (``rounding_tolerance``)."""
    leaves = jax.tree_util.tree_leaves(b)
    atols = [atol] * len(leaves) if np.isscalar(atol) else jax.tree_util.tree_leaves(atol)
    for x, y, tol in zip(jax.tree_util.tree_leaves(a), leaves, atols, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=float(tol), rtol=rtol)


EPS32 = float(np.finfo(np.float32).eps)


def rounding_tolerance(fn, *args, factor=16.0, seed=0, draws=1):
    """Per-leaf absolute tolerances for comparing ``fn(*args)`` with another program's result for the same math
    (another backend, batch layout, fusion or CPU): ``factor`` times how far each float output leaf moves when
    every float input element is scaled by 1 +- eps32 (signs at random; the most over ``draws`` draws of the
    signs), plus 4 eps32 times the leaf's size. One draw can leave a leaf that sums terms which nearly cancel
    (a mean of the clients' drifts, a hypernetwork's gradient from their updates) almost unmoved while another
    program's reassociation does move it: more draws see that.

    Why this bounds reassociation: reordering a float32 sum of n terms changes it by about the rounding of its
    terms (~sqrt(n) eps32 times their size), which is what rounding the inputs does, and the computation after
    it (optimizer steps, normalisation, an Adam step's division by a tiny second moment) amplifies both alike.
    A wrong computation (a dropped client, a padding row counted) moves the outputs by far more, so a test
    with this tolerance still fails on it. ``fn`` should be jitted (the perturbed call reuses its program).
    -> a tree of floats shaped like ``fn``'s output."""
    rng = np.random.default_rng(seed)

    def nudge(a):
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):  # (integers, PRNG keys, bools)
            return a
        a = np.asarray(a)
        return (a * (1 + EPS32 * rng.choice([-1.0, 1.0], a.shape))).astype(a.dtype)

    base = jax.device_get(fn(*args))
    moves = [jax.device_get(fn(*jax.tree_util.tree_map(nudge, args))) for _ in range(draws)]

    def tol(x, *ys):
        x = np.asarray(x, np.float64)
        if x.size == 0:
            return 0.0
        moved = max(float(np.max(np.abs(x - np.asarray(y, np.float64)))) for y in ys)
        return factor * moved + 4 * EPS32 * float(np.max(np.abs(x)))
    return jax.tree_util.tree_map(tol, base, *moves)


def rounds_tolerance(alg, data, server, clients, root, rounds=1, factor=16.0, **step_kw):
    """``rounding_tolerance`` of ``rounds`` rounds of ``alg``'s cohort step (``make_step``, ``step_kw`` to it:
    num_rounds, weighting, ...), jitted, with every client in the cohort, from the float trees (server, clients)
    (``data``'s integer samples are not nudged): the tolerance trees (server, clients, last round's metrics) for
    comparing another program's rounds of the same math (a backend's round, an algorithm that reduces to
    ``alg``) with these rounds."""
    from jaxfl.core.step import make_step
    step = make_step(alg, **step_kw)
    fn = jax.jit(lambda server, clients: step_rounds(step, data, server, clients, root, rounds))
    return rounding_tolerance(fn, server, clients, factor=factor)


_TRACING: list = []  # the lists of the traces() blocks open now
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def traces():
    """A list that gets the name of each function jax traces inside the block, as it happens: a jit cache miss,
    so a new program (a persistent-cache hit is traced too, so the count does not depend on that cache)."""
    if not getattr(traces, "listening", False):
        def listen(event, duration, **kw):
            if event == _TRACE_EVENT:
                for found in _TRACING:
                    found.append(kw.get("fun_name", "?"))
        jax.monitoring.register_event_duration_secs_listener(listen)
        traces.listening = True
    found: list = []
    _TRACING.append(found)
    try:
        yield found
    finally:
        _TRACING.remove(found)


@pytest.fixture(scope="session")
def data_dir():
    """The shared benchmark data; CI sets JAXFL_DATA_DIR. These tests must run, never skip, in CI."""
    path = os.environ.get("JAXFL_DATA_DIR") or (str(SHARED_DATA) if SHARED_DATA.is_dir() else None)
    if path is None:
        if os.environ.get("CI"):
            raise RuntimeError("CI must set JAXFL_DATA_DIR to the shared benchmark data")
        pytest.skip("no benchmark data: set JAXFL_DATA_DIR")
    return path


def setup_algorithm(name, model, counts, m=None, num_rounds=None, **trainer_kw):
    """(alg, data, server, clients) for ``name`` on random client data with the given sample counts
    (padded to ``m``); ``trainer_kw`` go to ``make_trainer``, ``options`` to the algorithm; the run context
    has the client count and ``num_rounds``."""
    from jaxfl.algorithms import build_algorithm
    from jaxfl.core.step import init_state
    from jaxfl.core.types import RunContext
    data = make_data(list(counts), m=m)
    opts = trainer_kw.pop("options", {})
    ctx = RunContext(num_clients=len(counts), num_rounds=num_rounds)
    alg = build_algorithm(name, model, make_trainer(**trainer_kw), ctx, **opts)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(counts))
    return alg, data, server, clients


def ragged(data: ClientData):
    """The real samples of padded ClientData as RaggedClients (what the backends store)."""
    from jaxfl.data.ragged import RaggedClients
    x, y, n = np.asarray(data.x), np.asarray(data.y), np.asarray(data.count)
    return RaggedClients.from_clients([(x[i, :c], y[i, :c]) for i, c in enumerate(n)])


BACKENDS = ("stacked", "ragged")


def make_backend(alg, data, backend="stacked", *, clients="vmap", cohort_size=None,
                 weighting="samples", num_rounds=None, batch_size=8, **kw):
    """A ``Stacked``, ``Streamed`` or ``Ragged`` backend of ``alg`` over the real samples of padded ``data`` (the
    runner's engine); ``clients``: its ``ClientMap`` (with its mesh, if any) or the map's name; ``batch_size``
    only sets the padding grid (use the trainer's); ``kw`` go to the backend (e.g. ``stragglers``)."""
    from jaxfl.core.backends import Ragged, Stacked, Streamed
    cls = {"stacked": Stacked, "streamed": Streamed, "ragged": Ragged}[backend]
    if backend in ("ragged", "streamed"):
        kw = {"client_store": "device", **kw}
    return cls(alg, ragged(data), batch_size=batch_size, clients=clients, cohort_size=cohort_size,
               weighting=weighting, num_rounds=num_rounds, **kw)


def run_rounds(alg, data, server, states, root, rounds=1, backend="stacked", keep_rows=False, every_round=False,
               **backend_kw):
    """``rounds`` rounds of ``alg`` on a backend (``make_backend``) from (server, the clients' states stacked [N]);
    returns (server, clients, last round's metrics), and with ``keep_rows`` also the last round's trained rows
    (stacked in cohort order: what ``trained_rows`` computes, without compiling a second program). With
    ``every_round``: a list of each round's (server, clients, metrics), fetched to the host (one run, one
    compilation, instead of a run per round count)."""
    from jaxfl.core.backends import ClientStore
    engine = make_backend(alg, data, backend, **backend_kw)
    store = ClientStore(jax.tree_util.tree_map(jnp.array, states), "device")  # a copy: rounds donate it
    kept, history = [], []
    hook = (lambda s, trained, ids: kept.append(jax.tree_util.tree_map(jnp.array, trained))) if keep_rows else None
    for r in range(rounds):
        server, metrics = engine.round(server, store, r, root, before_aggregate=hook if r == rounds - 1 else None)
        if every_round:
            history.append(jax.device_get((server, store.state, metrics)))
    if every_round:
        return history
    return (server, store.state, metrics, kept[-1]) if keep_rows else (server, store.state, metrics)


def engine_rounds(engine, server, states, root, rounds=2):
    """``rounds`` rounds from round 0 on a built backend (its compiled programs reused), from copies of (server, the
    clients' states stacked [N]) (the rounds donate their inputs): (server, clients, [each round's per-client
    loss], [each round's metrics])."""
    from jaxfl.core.backends import ClientStore
    store = ClientStore(jax.tree_util.tree_map(jnp.array, states), "device")
    server, metrics = engine.run_rounds(jax.tree_util.tree_map(jnp.array, server), store, 0, rounds, root)
    return server, store.state, [m["loss"] for m in metrics], metrics


def round_function(alg, backend="stacked", **backend_kw):
    """fn(server, clients, data, round_idx, root) -> (server, clients, metrics): one round of ``alg`` on a
    backend, built once per set of client sizes and reused (one compilation) for data of those sizes."""
    from jaxfl.core.backends import ClientStore
    engines = {}

    def fn(server, clients, data, round_idx, root):
        key = (data.x.shape, tuple(np.asarray(data.count).tolist()))
        if key not in engines:
            engines[key] = make_backend(alg, data, backend, **backend_kw)
        engine = engines[key]
        if backend == "stacked":
            engine.load(ragged(data))
        else:
            engine.train = ragged(data)
        store = ClientStore(jax.tree_util.tree_map(jnp.array, clients), "device")
        server, metrics = engine.round(server, store, round_idx, root)
        return server, store.state, metrics
    return fn


def evaluator(alg, test: ClientData, train: ClientData | None = None, eval_batch_size=8, **kw):
    """The runner's ``Evaluator`` of ``alg`` on the real samples of padded ``test`` (and ``train``)."""
    from jaxfl.core.evaluate import Evaluator
    return Evaluator(alg, ragged(test), eval_batch_size=eval_batch_size, preprocess=make_trainer().preprocess,
                     train=None if train is None else ragged(train), **kw)


def run_step(alg, data, server, states, root, rounds=1, clients="vmap", num_rounds=None):
    """``rounds`` rounds of the pure cohort step (``make_step``, jitted) with every client in the cohort and
    ``data`` exactly as given (padding included): (server, clients, last metrics)."""
    from jaxfl.core.step import make_step
    cohort_step = make_step(alg, clients=clients, num_rounds=num_rounds)
    return step_rounds(jax.jit(lambda *args: cohort_step(*args)), data, server, states, root, rounds)


def step_rounds(step, data, server, clients, root, rounds):
    """Rounds 0 .. rounds - 1 of a cohort ``step`` (``make_step``'s, jitted or not) with every client in the
    cohort: (server, clients, last metrics)."""
    ids, metrics = jnp.arange(data.num_clients), None
    for r in range(rounds):
        server, clients, metrics = step(server, clients, data, ids, r, root)
    return server, clients, metrics


def trained_rows(alg, data, server, clients, root, round_idx=0, num_rounds=None):
    """Every client's full state right after its local update of round ``round_idx`` (before aggregation),
    with the engine's per-client keys and RoundInfo: what the server averages, which clients do not keep."""
    from jaxfl.core.step import cohort_train
    update = cohort_train(alg, clients="vmap", num_rounds=num_rounds)
    return update(server, clients, data, jnp.arange(data.num_clients), round_idx, root)[0]


def info(round_idx, client_id, num_rounds=None):
    """A RoundInfo as the engine builds it (client_id: an int or a list of ints)."""
    from jaxfl.core.types import RoundInfo
    return RoundInfo(jnp.asarray(round_idx, jnp.int32), jnp.asarray(client_id, jnp.int32), num_rounds)


def assert_cli_runs(name, tmp_path, *extra):
    """``jaxfl run --algorithm name`` for 2 rounds of a tiny run (plus ``extra`` flags) exits 0 and writes a
    summary of round 2 with accuracies in [0, 1]."""
    import json

    from jaxfl.run.cli import main
    assert main(["run", "--quiet", "--algorithm", name, "--rounds", "2", "--out", str(tmp_path / "r"),
                 "--model", "small_cnn", "--image-size", "12", "--samples-per-client", "40", "--batch-size", "16",
                 "--test-per-client", "30", *extra]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["last"]["round"] == 2 and 0.0 <= summary["last"]["mean_accuracy"] <= 1.0


def padded_batch(seed=7, n=8, real=5, shape=(8, 8, 3), classes=4):
    """(x, y, w): a batch of n images whose last n - real rows are padding (w = 0) holding garbage."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n,) + shape), jnp.float32)
    y = jnp.asarray(rng.integers(0, classes, n), jnp.int32)
    w = jnp.asarray(np.arange(n) < real, jnp.float32)
    return x, y, w


# The longest tests (subprocess checks, GP fits) go first: pytest-xdist hands tests out in collection order, and
# a long test drawn last keeps one worker busy while the other idles (measured: ~50 s of the suite's wall time).
FIRST = ("test_sharding.py", "test_multihost.py", "test_pfedgp.py", "test_gp.py", "test_faults.py")


# A compile cache folder of an earlier run older than this was left by a run that was killed outright (SIGKILL,
# a lost machine): a running suite adds entries to its folder, which keeps its modification time recent.
STALE_CACHE_S = 24 * 3600


def _stop_as_interrupted(signum, frame):
    """SIGTERM (a CI timeout, ``kill``) stops the run as Ctrl-C does: pytest still calls
    ``pytest_sessionfinish``, which removes the compile cache."""
    raise KeyboardInterrupt(f"signal {signum}")


def remove_stale_caches(folder: Path, own: Path, now: float, max_age_s: float = STALE_CACHE_S) -> list[Path]:
    """Remove the ``CACHE_PREFIX*`` folders in ``folder`` other than ``own`` last modified more than
    ``max_age_s`` seconds before ``now``; returns them."""
    import shutil
    stale = [p for p in sorted(folder.glob(CACHE_PREFIX + "*"))
             if p.is_dir() and p != own and now - p.stat().st_mtime > max_age_s]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def pytest_sessionfinish(session, exitstatus):
    """Remove this run's compile cache (~115 MB) from the temporary folder: the tests leave nothing behind, also
    when the run is stopped by Ctrl-C or SIGTERM (``_stop_as_interrupted``); a folder a killed run left is removed
    by the next run a day later (``remove_stale_caches``)."""
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        import shutil
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")  # tools/slow_tests.py writes it from a full run


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full tier (what CI runs): every test; without it, the tests of tests/slow_tests.txt "
                          "are left out unless named on the command line (the fast tier, for the edit-test loop)")


def fast_tier(config) -> bool:
    """Whether this run leaves out the slow tests: no --full, and no test picked by node id, -k or -m."""
    picked = any("::" in str(a) for a in config.args) or config.getoption("keyword") or config.getoption("markexpr")
    return not config.getoption("--full") and not picked


def pytest_report_header(config):
    if fast_tier(config):
        return "fast tier: the tests of tests/slow_tests.txt are left out (--full runs every test)"


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    if fast_tier(config) and SLOW_TESTS.is_file():
        slow = {line.strip() for line in SLOW_TESTS.read_text().splitlines() if line.strip() and line[0] != "#"}
        left_out = [item for item in items if item.nodeid in slow]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.nodeid not in slow]


# -- TFF's HDF5 files, written small in their exact layout (tests/test_tff_data.py, the FedOpt settings)
def write_tff(path, clients: dict):
    """A TFF HDF5 file: examples/<client>/<field> = array (h5py, which the test extra installs)."""
    import h5py
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for cid, fields in clients.items():
            g = f.create_group(f"examples/{cid}")
            for k, v in fields.items():
                g.create_dataset(k, data=v)


def emnist_files(folder, writers=("f0000_14", "f0001_41", "f0002_33"), n=(12, 7, 9), only_test=(), seed=0):
    """TFF's EMNIST pair (fed_emnist_train.h5, fed_emnist_test.h5) in ``folder``: random 28x28 pixels in [0, 1] and
    labels in [0, 62) for each writer (a third as many test images); ``only_test`` writers have no training file
    entry."""
    rng = np.random.default_rng(seed)
    for split in ("train", "test"):
        clients = {}
        for w, k in zip(writers, n):
            if split == "train" and w in only_test:
                continue
            k = k if split == "train" else max(2, k // 3)
            clients[w] = {"pixels": rng.uniform(0, 1, (k, 28, 28)).astype(np.float32),
                          "label": rng.integers(0, 62, k).astype(np.int32)}
        write_tff(folder / f"fed_emnist_{split}.h5", clients)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Every test leaves SIGINT's and SIGTERM's handlers as it found them: a handler left behind (e.g. SIGINT
    ignored) would change what a later test in the same worker, or a child process it starts, does on a stop
    signal. Restored, and the test fails naming the handler."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    after = {s: signal.getsignal(s) for s in before}
    changed = {s.name: (before[s], after[s]) for s in before if after[s] is not before[s]}
    for s in before:
        signal.signal(s, before[s])
    assert not changed, f"the test left signal handlers changed (before, after): {changed}"
