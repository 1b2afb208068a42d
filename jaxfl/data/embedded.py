"""The embedded offline benchmark: three digit domains built at run time from real images that installed
packages ship, so a first run needs no network and no data directory.

- ``sk-digits``: scikit-learn's 1,797 handwritten 8x8 digits (UCI optdigits), upsampled, grey.
- ``sk-digits-photo``: the other half of those digits blended with real photo patches (scikit-learn's
  sample photos) by MNIST-M's recipe, out = |patch - digit|.
- ``font-digits``: digits rendered from the TrueType fonts matplotlib ships, with random colours, size,
  position and rotation, then blurred: SynthDigits' recipe.

These are stand-ins built by the published recipes; they are not MNIST, MNIST-M or SynthDigits. The images
are generated with a fixed seed, so the benchmark is the same on every machine.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np

from ..errors import DataError
from .transforms import resize_images, to_channels


DOMAINS = ("sk-digits", "sk-digits-photo", "font-digits")
_SEED = 20261122


def sklearn_datasets_dir() -> Path:
    """scikit-learn's ``datasets`` folder, found without importing scikit-learn (1.7 s of a run's start-up):
    the files read below are what its ``load_digits`` and ``load_sample_images`` read."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded benchmark (--dataset default) reads scikit-learn's data files: pip install "
                        "scikit-learn")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets"


def sklearn_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """(images float [1797, 8, 8] in 0..16, labels int64 [1797]): ``sklearn.datasets.load_digits``'s data, read
    from its CSV (pixels, then the label, per row)."""
    with gzip.open(sklearn_datasets_dir() / "data" / "digits.csv.gz", "rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def sklearn_sample_photos() -> list[np.ndarray]:
    """``sklearn.datasets.load_sample_images().images``: its JPEG photos in file-name order, uint8 [H, W, 3]."""
    from PIL import Image
    photos = []
    for path in sorted((sklearn_datasets_dir() / "images").glob("*.jpg")):
        with Image.open(path) as im:
            photos.append(np.asarray(im))
    return photos


def _sklearn_digits(size: int):
    digits, labels = sklearn_digits_images()
    images = np.clip(digits * (255.0 / 16.0), 0, 255).astype(np.uint8)[..., None]
    return resize_images(images, size), labels


def _photo_blend(digits, rng):
    """MNIST-M: |photo patch - digit| per channel, a random patch of a random photo for each digit."""
    photos = sklearn_sample_photos()
    n, s = len(digits), digits.shape[1]
    out = np.empty((n, s, s, 3), np.uint8)
    grey = to_channels(digits, 3).astype(np.int16)
    for i in range(n):
        p = photos[rng.integers(len(photos))]
        r, c = rng.integers(p.shape[0] - s), rng.integers(p.shape[1] - s)
        out[i] = np.abs(p[r:r + s, c:c + s].astype(np.int16) - grey[i]).astype(np.uint8)
    return out


def _font_digits(n: int, size: int, rng):
    """SynthDigits-style renders: one centred digit, random font, colours, scale, shift, rotation, blur."""
    import matplotlib
    from PIL import Image, ImageDraw, ImageFilter, ImageFont
    font_dir = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
    fonts = [os.path.join(font_dir, f) for f in sorted(os.listdir(font_dir))
             if f.startswith("DejaVu") and f.endswith(".ttf") and "Display" not in f]
    big = 2 * size  # draw at twice the size, then downsample (antialiasing)
    labels = np.arange(n) % 10
    rng.shuffle(labels)
    images = np.empty((n, size, size, 3), np.uint8)
    for i, label in enumerate(labels):
        bg = tuple(int(v) for v in rng.integers(0, 256, 3))
        fg = tuple(int(v) ^ 0x80 for v in bg)  # far from the background in every channel
        im = Image.new("RGB", (big, big), bg)
        font = ImageFont.truetype(fonts[rng.integers(len(fonts))], int(big * rng.uniform(0.55, 0.85)))
        draw = ImageDraw.Draw(im)
        x0, y0, x1, y1 = draw.textbbox((0, 0), str(label), font=font)
        dx, dy = rng.uniform(-0.1, 0.1, 2) * big
        draw.text(((big - (x1 - x0)) / 2 - x0 + dx, (big - (y1 - y0)) / 2 - y0 + dy), str(label), fill=fg,
                  font=font)
        im = im.rotate(rng.uniform(-15, 15), resample=Image.BILINEAR, fillcolor=bg)
        im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0, 1.5))).resize((size, size), Image.BILINEAR)
        images[i] = np.asarray(im)
    return images, labels.astype(np.int64)


def load_embedded(size: int = 32, font_samples: int = 1000) -> dict:
    """{domain: (images uint8 [N, size, size, C], labels)} for the three embedded domains.

    The scikit-learn digits are split in two disjoint halves (one per sklearn domain), so no image appears
    in two domains.
    """
    rng = np.random.default_rng(_SEED)
    images, labels = _sklearn_digits(size)
    order = rng.permutation(len(labels))
    a, b = order[: len(order) // 2], order[len(order) // 2:]
    return {
        "sk-digits": (images[a], labels[a]),
        "sk-digits-photo": (_photo_blend(images[b], rng), labels[b]),
        "font-digits": _font_digits(font_samples, size, rng),
    }
