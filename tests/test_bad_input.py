"""Bad input through the CLI entry point: one line `jaxfl: error: ...`, exit status 2, nothing written.

Every case runs in an empty working directory (a run without --out would write under ./runs) and checks that
the directory tree is unchanged afterwards.
"""
import os

import numpy as np
import pytest

from jaxfl.run.cli import main


TINY = ["--model", "small_cnn", "--image-size", "12", "--samples-per-client", "20", "--rounds", "1"]


def tree(root):
    """{relative path: (size, mtime_ns)} of everything under ``root``."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(base, name)
            st = os.lstat(p)  # (a symbolic link as itself: a dangling one has nothing to stat)
            out[os.path.relpath(p, root)] = (st.st_size if name in files else -1, st.st_mtime_ns)
    return out


def write_npz(path, images, labels):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, images=images, labels=labels)


def mnist_dir(root, labels=None, images=lambda x: x, shape=lambda y: y):
    """A tiny data directory with digits/mnist_{train,test}.npz (labels in [0, 10) unless given; ``images`` and
    ``shape`` transform the arrays saved)."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        y = rng.integers(0, 10, 300) if labels is None else np.resize(labels, 300)
        write_npz(root / "digits" / f"mnist_{split}.npz",
                  images(rng.integers(0, 256, (300, 28, 28), dtype=np.uint8)), shape(y))
    return root


def empty_test(root):
    write_npz(root / "digits" / "mnist_test.npz", np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.int64))
    return root


CASES = {
    # crashed with a traceback
    "malformed toml": (lambda d: ["--config", str(write(d / "c.toml", "rounds = = 3"))], "is not valid TOML"),
    "malformed json": (lambda d: ["--config", str(write(d / "c.json", "{rounds: 3"))], "is not valid JSON"),
    "wrong type in a config file": (lambda d: ["--config", str(write(d / "c.toml", 'rounds = "five"'))],
                                    "rounds='five' must be an integer"),
    "--out is a file": (lambda d: ["--out", str(write(d / "taken", "x"))], "is a file; give a folder"),
    "--out cannot be written": (lambda d: ["--out", "/sys/jaxfl-test-out"], "is not a writable folder"),
    "--compile-cache is a file": (lambda d: ["--compile-cache", str(write(d / "cache", "x"))],
                                  "is not a folder; give a folder, or none"),
    "--compile-cache cannot be written": (lambda d: ["--compile-cache", "/sys/jaxfl-test-cache"],
                                          "'/sys' is not writable; give a writable folder, or none"),
    "corrupt npz": (lambda d: ["--dataset", "mnist", "--data-dir", str(corrupt(d / "data"))],
                    "is not a readable .npz archive"),
    "--devices beyond the machine": (lambda d: ["--devices", "64"],
                                     "devices=64: a CPU run makes at most one device per core and this machine has "),
    "a model the algorithm cannot use": (lambda d: ["--algorithm", "fedtp"],
                                         "--algorithm fedtp cannot use --model small_cnn"),
    "images too small for the model": (lambda d: ["--model", "alexnet_bn"],  # (crashed: a ZeroDivisionError)
                                       "model alexnet_bn needs images of at least 63x63 pixels (e.g. --dataset "
                                       "pacs), got 12x12"),
    "a text model on images": (lambda d: ["--model", "char_lstm"], "--model char_lstm reads text (token ids) and "
                               "--dataset default holds images; use a text dataset (synthetic_text, text:PATH"),
    "an image model on text": (lambda d: ["--dataset", "synthetic_text", "--model", "logreg"],
                               "--dataset synthetic_text holds text (token ids) and --model logreg reads images"),
    "image augmentation on text": (lambda d: ["--dataset", "synthetic_text", "--model", "char_lstm", "--augment",
                                              "flip"], "--augment flip: --dataset synthetic_text holds text (token "
                                                       "ids); image augmentation applies to image datasets only"),
    "augmentation where local training has its own minibatch loop": (
        lambda d: ["--algorithm", "perfedavg", "--augment", "flip"],
        "--augment flip: perfedavg's local training draws its minibatches in a loop of its own"),
    "an unknown augmentation parameter": (lambda d: ["--augment", "crop_flip:size=3"],
                                          "augment='crop_flip:size=3': 'size=3' is not a parameter of crop_flip"),
    "an image-only algorithm on text": (lambda d: ["--dataset", "synthetic_text", "--algorithm", "fedtp", "--model",
                                                   "vit_tiny"], "and --model vit_tiny reads images; text needs "
                                                                "--model char_lstm"),
    "a label-skew option on a domain dataset": (lambda d: ["--partition", "dirichlet"],
                                                "--partition dirichlet: --dataset default has one client per domain "
                                                "(--clients-per-domain k splits each into k), so it would be ignored; "
                                                "it applies to mnist, cifar10, tfds:NAME"),
    "a domain option on a label-skew dataset": (lambda d: ["--dataset", "mnist", "--clients-per-domain", "2"],
                                                "--clients-per-domain 2: --dataset mnist is split by label"),
    "a prefix without its path": (lambda d: ["--dataset", "text:", "--model", "char_lstm"],
                                  "--dataset 'text:': give the PATH after 'text:' (text:PATH)"),
    "--seed -1": (lambda d: ["--seed", "-1"], "seed=-1 must be at least 0"),
    "an integer too large for the arrays": (lambda d: ["--seed", "99999999999999999999"],
                                            "seed=99999999999999999999 is too large (at most 2147483647)"),
    "an algorithm's integer option too large": (lambda d: ["--algorithm", "fedselect", "--fedselect.grow-every",
                                                           "99999999999"], "fedselect.grow_every=99999999999 is too "
                                                                           "large (at most 2147483647)"),
    "--image-size -8": (lambda d: ["--image-size", "-8"], "image_size=-8 must be at least 1"),
    "--fedtp.embed-dim 0": (lambda d: ["--algorithm", "fedtp", "--model", "vit_tiny", "--fedtp.embed-dim", "0"],
                            "fedtp.embed_dim=0 must be at least 1"),
    # accepted silently before
    "--num-clients 0": (lambda d: ["--num-clients", "0"], "num_clients=0 must be at least 1"),
    "--samples-per-client -5": (lambda d: ["--samples-per-client", "-5"], "samples_per_client=-5 must be at least 1"),
    "--test-per-client -1": (lambda d: ["--test-per-client", "-1"], "test_per_client=-1 must be at least 1"),
    "--image-size 0": (lambda d: ["--image-size", "0"], "image_size=0 must be at least 1"),
    "--dapperfl.gamma -1": (lambda d: ["--algorithm", "dapperfl", "--dapperfl.gamma", "-1"],
                            "dapperfl.gamma=-1.0 must be a finite number in [0.0, inf)"),
    "labels outside [0, K)": (lambda d: ["--dataset", "mnist", "--data-dir", str(mnist_dir(d / "data", [3, 12]))],
                              "label 12 is outside [0, 10) (150 such labels); digits has 10 classes"),
    # runs that would lose work
    "non-empty --out without --resume": (lambda d: ["--out", str(write(d / "old" / "metrics.jsonl", "{}").parent)],
                                         "is not empty; pass --resume to continue its run, --overwrite"),
    "--resume of a folder without a run": (lambda d: ["--resume", "--out", str(mkdir(d / "empty"))],
                                           "is empty: no run to continue (drop --resume to start one)"),
    "--resume of a folder that does not exist": (lambda d: ["--resume", "--out", str(d / "missing")],
                                                 "missing' does not exist: no run to continue (drop --resume, or"),
    "an empty --out": (lambda d: ["--out", ""], "--out '' is empty; give a folder"),
    "a dangling symlink as --out": (lambda d: ["--out", str(dangling(d / "link"))],
                                    "is a symbolic link to nothing (dangling, or a loop)"),
    "--out below a dangling symlink": (lambda d: ["--out", str(dangling(d / "link") / "sub")],
                                       "/link', a symbolic link to nothing (dangling, or a loop); give a folder"),
    "--out below a symlink loop": (lambda d: ["--out", str(loop(d / "loop") / "sub" / "deeper")],
                                   "/loop', a symbolic link to nothing (dangling, or a loop); give a folder"),
    "a sweep into a dangling symlink": (lambda d: ["--seeds", "0,1", "--out", str(dangling(d / "link"))],
                                        "/link', a symbolic link to nothing (dangling, or a loop); give a folder"),
    "a symlink to an unwritable folder as --out": (lambda d: ["--out", str(link_to(d / "link", "/sys"))],
                                                   "' is not writable"),
    "a JSON config with a key twice": (lambda d: ["--config", str(write(d / "twice.json",
                                                                        '{"rounds": 2, "rounds": 3}'))],
                                       "is not valid JSON: key 'rounds' is given twice"),
    "an empty test split": (lambda d: ["--dataset", "mnist", "--data-dir", str(empty_test(mnist_dir(d / "data")))],
                            "mnist_test.npz' holds no samples (images (0, 28, 28, 1)); every test split needs"),
    "labels saved as a column": (lambda d: ["--dataset", "mnist", "--data-dir",
                                            str(mnist_dir(d / "data", shape=lambda y: y.reshape(-1, 2)))],
                                 "labels have shape (150, 2); give one integer class per sample, [N]"),
    "float images with NaN": (lambda d: ["--dataset", "mnist", "--data-dir",
                                         str(mnist_dir(d / "data", images=lambda x: np.where(x > 250, np.nan, x)))],
                              "images hold NaN or Inf"),
    "float images in [0, 1]": (lambda d: ["--dataset", "mnist", "--data-dir",
                                          str(mnist_dir(d / "data", images=lambda x: x / 255.0))],
                               "(floats in [0, 1]: multiply by 255 and save as uint8)"),
    "--clients-per-domain beyond a domain's samples": (lambda d: ["--clients-per-domain", "100000"],
                                                       "--clients-per-domain 100000: domain 'sk-digits' of default "
                                                       "has "),
    # 540 clients x ~290 MB of digits_cnn on 64 x 64 inputs ~ 157 GB: refused below ~300 GB of memory
    "a cohort whose trained models cannot fit": (lambda d: ["--model", "digits_cnn", "--image-size", "64",
                                                            "--clients-per-domain", "180", "--samples-per-client",
                                                            "1"],
                                                 "clients a round (every client trains every round) hold"),
    "--resume and --overwrite": (lambda d: ["--resume", "--overwrite", "--out", str(d / "o")],
                                 "--resume continues the run in --out, --overwrite replaces it"),
    "--stragglers 1.5": (lambda d: ["--stragglers", "1.5"], "stragglers=1.5 is outside [0.0, 1.0]"),
    "a JSON null where a value is needed": (lambda d: ["--config", str(write(d / "c.json", '{"stragglers": null}'))],
                                            "stragglers=null needs a value (default: 0.0)"),
    "--stragglers with one local epoch": (lambda d: ["--stragglers", "0.5"],
                                          "stragglers=0.5: a straggler runs 1 to E-1 of its E local_epochs, so "
                                          "--local-epochs must be at least 2 (it is 1)"),
    "--stragglers with one FedSelect alternation": (lambda d: ["--algorithm", "fedselect", "--stragglers", "0.9",
                                                               "--local-epochs", "5"],
                                                    "of its E la_epochs, so --fedselect.la-epochs must be at least 2 "
                                                    "(it is 1)"),
    "--seeds with a repeat": (lambda d: ["--seeds", "0,1,0"], "--seeds '0,1,0': give distinct integers >= 0"),
    "--seeds and --seed": (lambda d: ["--seeds", "0,1", "--seed", "2"], "--seed 2 and --seeds 0,1: give one of them"),
    "--seeds with a used seed folder": (lambda d: ["--seeds", "0,1", "--out", str(write(d / "s" / "seed1" / "x", "")
                                                                                 .parent.parent)],
                                        "seed1' is not empty; pass --resume"),
    "--seeds into a single run's folder": (lambda d: ["--seeds", "0,1", "--out",
                                                      str(write(d / "one" / "metrics.jsonl", "{}").parent)],
                                            "holds a run of its own; --seeds writes one run per seed"),
    "an option of another algorithm": (lambda d: ["--algorithm", "fedavg", "--fedselect.alpha", "0.5"],
                                       "--fedselect.alpha: option(s) of fedselect, but the algorithm is fedavg"),
    # refused by the argument parser, which printed its whole usage (~170 lines) first
    "--lr abc": (lambda d: ["--lr", "abc"],
                 "argument --lr: invalid float value: 'abc' (jaxfl run --help lists the options)"),
    "a list of numbers with a word in it": (lambda d: ["--algorithm", "heterofl", "--heterofl.device-ratios", "0,abc"],
                                            "argument --heterofl.device-ratios: invalid comma-separated numbers value: "
                                            "'0,abc'"),
    "an unknown flag": (lambda d: ["--bogus", "1"], "unrecognized arguments: --bogus 1 (jaxfl run --help"),
    "an abbreviated flag": (lambda d: ["--rounds-per-cal", "5"], "unrecognized arguments: --rounds-per-cal 5"),
}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def loop(path):
    """A symbolic link to itself at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(path, path)
    return path


def dangling(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(path.parent / "nowhere")
    return path


def link_to(path, target):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def mkdir(path):
    path.mkdir(parents=True)
    return path


def corrupt(root):
    for split in ("train", "test"):
        write_npz(root / "digits" / f"mnist_{split}.npz", np.zeros((10, 28, 28), np.uint8), np.zeros(10, np.int64))
        p = root / "digits" / f"mnist_{split}.npz"
        p.write_bytes(p.read_bytes()[:100])  # truncated
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    make_args, message = CASES[case]
    monkeypatch.chdir(tmp_path)
    args = make_args(tmp_path)
    before = tree(tmp_path)
    code = main(["run"] + TINY + args)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(err) == 1 and err[0].startswith("jaxfl: error: ") and message in err[0], err
    assert "Traceback" not in captured.err and captured.out == ""
    assert tree(tmp_path) == before  # no output folder created, nothing changed


def test_a_command_line_without_a_command_is_one_line_too(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxfl: error: the following arguments are required: command (jaxfl --help lists the options)"]


def test_help_lists_every_algorithms_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help text is wrapped
    assert e.value.code == 0
    assert "--fedselect.grow-every" in out and "r mod K = 0" in out and "fedpick options" in out
    # --dataset lists every preset and prefix the loader takes (generated from jaxfl.data.federated)
    assert ("default (embedded, offline) | digits | pacs | cifar10 | mnist | synthetic_text | tfds:NAME | "
            "folder:PATH | text:PATH | leaf:PATH | leaf_femnist:PATH") in out


def test_labels_saved_as_a_column_are_read_as_one_class_per_sample(tmp_path):
    from jaxfl.data.sources import load_npz
    y = np.arange(12) % 10
    write_npz(tmp_path / "digits" / "mnist_train.npz", np.zeros((12, 28, 28), np.float32) + 7.0, y[:, None])
    images, labels = load_npz(tmp_path, "digits", "mnist", "train", 10)
    assert labels.tolist() == y.tolist() and images.dtype == np.uint8 and images.shape == (12, 28, 28, 1)
    assert np.all(images == 7)  # whole-number floats in [0, 255] are pixels
