"""Writes examples/my_images.npz: scikit-learn's 8x8 handwritten digits in the layout `--config.data.kind=npz`
reads, as an example of your own images (python examples/make_my_images.py rewrites it).

  train_images, test_images  uint8 (N, H, W, C), here (1437, 8, 8, 1) and (360, 8, 8, 1), values 0..255
  train_labels, test_labels  integer (N,), here 0..9
"""

import pathlib

import numpy as np
from sklearn.datasets import load_digits


def main() -> None:
    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]  # 0..16 -> 0..255, one channel
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[:360], order[360:]
    out = pathlib.Path(__file__).with_name("my_images.npz")
    np.savez_compressed(out, train_images=images[train], train_labels=digits.target[train].astype(np.int32),
                        test_images=images[test], test_labels=digits.target[test].astype(np.int32))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
