"""Do jaxfl's ``crop_flip`` and the FedSelect adapter's crop + flip (torchvision's RandomCrop(32, padding=4) +
RandomHorizontalFlip draws, on torch's global RNG) pick the same crops and flips with the same law?

    PYTHONPATH=<site-packages with jax>:<repository> python experiments/official/augment_law.py [--draws 20000]

One random 32x32x3 image is augmented ``--draws`` times by each code; each output is identified as one of the
162 cells (top, left, flip) of the 9 x 9 offsets and 2 flips (every cell's image is distinct, so the
identification is exact and fails loudly on an output that is none of them). Prints the counts' chi-square
p-values against the uniform law (each code) and between the codes (a 2 x 162 contingency table), and the
flip shares. Needs torch (the adapter's side) and scipy.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SIZE, PAD = 32, 4


def cells(img: np.ndarray) -> dict[bytes, tuple[int, int, int]]:
    """{output image bytes: (top, left, flip)} for every crop offset and flip of ``img`` [H, W, C] uint8."""
    padded = np.pad(img, ((PAD, PAD), (PAD, PAD), (0, 0)))
    out = {}
    for top in range(2 * PAD + 1):
        for left in range(2 * PAD + 1):
            crop = padded[top:top + SIZE, left:left + SIZE]
            out[crop.tobytes()] = (top, left, 0)
            out[crop[:, ::-1].tobytes()] = (top, left, 1)
    assert len(out) == 2 * (2 * PAD + 1) ** 2, "the test image must make every cell distinct"
    return out


def counts(outputs, table) -> np.ndarray:
    """[9, 9, 2] counts of the cells of ``outputs`` (uint8 [H, W, C] images); KeyError on any other image."""
    c = np.zeros((2 * PAD + 1, 2 * PAD + 1, 2), int)
    for o in outputs:
        c[table[np.ascontiguousarray(o).tobytes()]] += 1
    return c


def jaxfl_outputs(img: np.ndarray, draws: int, seed: int) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from jaxfl.ops.augment import make_augment
    x = jnp.asarray(np.repeat(img[None], draws, 0))
    return np.asarray(jax.jit(make_augment(f"crop_flip:pad={PAD}"))(jax.random.key(seed), x))


def adapter_outputs(img: np.ndarray, draws: int, seed: int):
    import torch

    from fedselect import ArrayDataset
    ds = ArrayDataset(img[None], np.zeros(1, int), (0.0, 1.0), augment=True)  # unit scaling: x / 255 back
    torch.manual_seed(seed)
    for _ in range(draws):
        t, _ = ds[0]
        yield np.rint(t.numpy().transpose(1, 2, 0) * 255).astype(np.uint8)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draws", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from scipy.stats import chi2_contingency, chisquare

    img = np.random.default_rng(args.seed).integers(1, 256, (SIZE, SIZE, 3)).astype(np.uint8)
    table = cells(img)
    cj = counts(jaxfl_outputs(img, args.draws, args.seed), table)
    ct = counts(adapter_outputs(img, args.draws, args.seed), table)
    print(f"{args.draws} draws a code, {cj.size} cells (top, left, flip)")
    for name, c in (("jaxfl crop_flip", cj), ("adapter (torchvision's draws)", ct)):
        print(f"{name}: chi-square against uniform p = {chisquare(c.ravel()).pvalue:.3f}, "
              f"flip share {c[..., 1].sum() / args.draws:.4f}")
    print(f"between the codes: chi-square p = {chi2_contingency(np.stack([cj.ravel(), ct.ravel()]))[1]:.3f}")


if __name__ == "__main__":
    main()
