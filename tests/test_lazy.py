"""Inputs read when used (``jaxfl.data.lazy``): lazy arrays compose, a lazy flat store indexes like the array it
replaces and reads only the clients an index touches, and a run on a TFF file gives the same metrics whether its
images are read lazily or at load."""
import json

import numpy as np
import pytest
from conftest import emnist_files

from jaxfl.data import DataConfig, load_dataset
from jaxfl.data.lazy import LazyArray, LazyRows, is_lazy
from jaxfl.data.ragged import RaggedClients
from jaxfl.run.cli import main


def counted(a):
    """A LazyArray of ``a`` and the list its reads are appended to."""
    log = []
    return LazyArray(lambda: log.append(1) or a, a.shape, a.dtype), log


def test_lazy_array_reads_only_when_used_and_composes():
    a = np.arange(24, dtype=np.float32).reshape(6, 2, 2)
    lazy, log = counted(a)
    rows = np.array([4, 1, 1])
    doubled = lazy.take(rows).map(lambda v: (2 * v).astype(np.int16))
    assert not log  # nothing read yet
    assert doubled.shape == (3, 2, 2) and doubled.dtype == np.int16 and doubled.nbytes == 3 * 4 * 2
    np.testing.assert_array_equal(np.asarray(doubled), (2 * a[rows]).astype(np.int16))
    assert len(log) == 1 and len(lazy) == 6
    np.testing.assert_array_equal(lazy[2:4], a[2:4])
    bad = LazyArray(lambda: a[:5], a.shape, a.dtype)
    with pytest.raises(ValueError, match="promised"):
        bad.read()


def test_lazy_rows_index_like_the_flat_array_and_read_only_their_clients():
    rng = np.random.default_rng(0)
    sizes = [3, 0, 5, 1, 4]
    parts = [rng.normal(size=(n, 2)).astype(np.float32) for n in sizes]
    flat = np.concatenate(parts)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = LazyRows([counted(p)[0] for p in parts], offsets)
    assert rows.shape == flat.shape and rows.dtype == flat.dtype and rows.nbytes == flat.nbytes
    index = rng.integers(0, len(flat), (4, 3))
    np.testing.assert_array_equal(rows[index], flat[index])
    np.testing.assert_array_equal(rows[2:7], flat[2:7])
    np.testing.assert_array_equal(rows[-1], flat[-1])
    np.testing.assert_array_equal(np.asarray(rows), flat)
    fresh = LazyRows([counted(p)[0] for p in parts], offsets)
    fresh[np.array([3, 4, 7])]  # rows of client 2 (offset 3, 5 rows) only
    np.testing.assert_array_equal(fresh.reads, [0, 0, 1, 0, 0])
    with pytest.raises(IndexError):
        rows[np.array([len(flat)])]


def test_ragged_clients_of_lazy_inputs_gather_what_eager_ones_gather():
    rng = np.random.default_rng(1)
    clients = [(rng.integers(0, 255, (n, 3, 3, 1)).astype(np.uint8), rng.integers(0, 4, n)) for n in (5, 2, 7)]
    eager = RaggedClients.from_clients(clients)
    lazy = RaggedClients.from_clients([(counted(x)[0], y) for x, y in clients])
    assert isinstance(lazy.x, LazyRows) and lazy.nbytes == eager.nbytes
    for ids in ([0, 2], [2, -1, 1]):
        a, b = eager.gather(np.array(ids), 8), lazy.gather(np.array(ids), 8)
        for field in ("x", "y", "count"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    # client 2 in both gathers, 1 in the second; 0 in the first and for the second's empty lane (-1), whose
    # padding repeats the first sample of the store (as the eager store does)
    np.testing.assert_array_equal(lazy.x.reads, [2, 1, 2])


def test_auto_reads_tff_images_lazily_only_when_they_would_crowd_memory(tmp_path, monkeypatch):
    import jaxfl.data.federated as federated
    emnist_files(tmp_path)
    for mode, memory, want in (("auto", 1 << 40, False), ("auto", 1000, True), ("yes", 1 << 40, True),
                               ("no", 1000, False)):
        monkeypatch.setattr(federated, "host_memory_bytes", lambda: memory)
        ds = load_dataset(DataConfig(f"tff_emnist:{tmp_path}", channels=1, lazy_inputs=mode))
        assert all(is_lazy(x) == want for split in (ds.train, ds.test) for x, _ in split), (mode, memory)
        assert ds.input_shape == (28, 28, 1)


def run_log(tmp_path, name, *flags):
    out = tmp_path / name
    assert main(["run", "--dataset", f"tff_emnist:{tmp_path}", "--model", "femnist_cnn", "--algorithm", "fedavg",
                 "--rounds", "2", "--batch-size", "4", "--samples-per-client", "10", "--clients-per-round", "2",
                 "--quiet", "--out", str(out), *flags]) == 0
    clock = ("time_s", "compile_s", "host_share", "compiled_programs")  # (the process's, not the run's)
    return [{k: v for k, v in json.loads(line).items() if k not in clock}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["ragged", "streamed"])
def test_a_run_reads_lazily_what_it_reads_at_load(tmp_path, backend):
    """The same arrays either way, so the same metrics bit for bit (the CLI's path, a cohort of 2 of 3; the
    programs compiled differ: the second run in a process finds the first's)."""
    emnist_files(tmp_path)
    eager = run_log(tmp_path, "eager", "--lazy-inputs", "no", "--backend", backend)
    lazy = run_log(tmp_path, "lazy", "--lazy-inputs", "yes", "--backend", backend)
    assert lazy == eager and len(lazy) == 2


def test_a_round_reads_its_cohort_only(tmp_path):
    from jaxfl.run.config import RunConfig
    from jaxfl.run.runner import Experiment
    emnist_files(tmp_path, writers=[f"w{i}" for i in range(6)], n=[6, 7, 5, 8, 6, 9])
    exp = Experiment(RunConfig(dataset=f"tff_emnist:{tmp_path}", model="femnist_cnn", rounds=1, batch_size=4,
                               clients_per_round=2, lazy_inputs="yes", backend="ragged", devices=1))
    history = exp.run().history
    reads = exp.train_data.x.reads
    cohort = history[-1]["clients_trained"]
    assert sorted(np.flatnonzero(reads)) == sorted(exp.dataset.client_names.index(c) for c in cohort)


def test_a_backdoor_attack_on_lazy_inputs_is_refused_in_one_line(tmp_path, capsys):
    emnist_files(tmp_path)
    out = tmp_path / "run"
    assert main(["run", "--dataset", f"tff_emnist:{tmp_path}", "--model", "femnist_cnn", "--lazy-inputs", "yes",
                 "--attack", "backdoor", "--malicious", "0.34", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attack backdoor" in err[0] and "--lazy-inputs no" in err[0]
    assert not out.exists()


def cifar100_files(folder):
    from conftest import write_tff
    rng = np.random.default_rng(0)
    write_tff(folder / "fed_cifar100_train.h5",
              {str(i): {"image": rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8),
                        "label": rng.integers(0, 100, 10)} for i in range(3)})
    write_tff(folder / "fed_cifar100_test.h5", {"9": {"image": np.zeros((1, 32, 32, 3), np.uint8),
                                                      "label": np.zeros(1, np.int64)}})
    return f"tff_cifar100:{folder}"


def flair(folder):
    from test_multilabel import flair_file
    flair_file(folder / "flair.hdf5")
    return f"flair:{folder / 'flair.hdf5'}"


def emnist(folder):
    emnist_files(folder)
    return f"tff_emnist:{folder}"


@pytest.mark.parametrize("files", [emnist, cifar100_files, flair])
def test_each_image_loader_gives_lazily_the_arrays_it_reads_at_load(tmp_path, files):
    """Every image loader of natural clients, resized and capped as a run asks (--image-size 16,
    --samples-per-client 5): lazy and eager datasets hold equal arrays, clients, labels and draws."""
    pytest.importorskip("h5py")
    dataset = files(tmp_path)
    kw = dict(image_size=16, samples_per_client=5, channels=3)
    lazy, eager = (load_dataset(DataConfig(dataset, lazy_inputs=m, **kw)) for m in ("yes", "no"))
    assert lazy.client_names == eager.client_names and lazy.input_shape == eager.input_shape == (16, 16, 3)
    for a, b in zip(lazy.train + lazy.test, eager.train + eager.test):
        assert isinstance(a[0], LazyArray) and isinstance(b[0], np.ndarray)
        np.testing.assert_array_equal(np.asarray(a[0]), b[0])
        np.testing.assert_array_equal(a[1], b[1])
