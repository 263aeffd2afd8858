"""Write scikit-learn's wine data as a directory of files, the layout of ``fedge.plugins.load_class_folders``.

    python examples/custom_model/make_wine_files.py OUT_DIR

writes ``OUT_DIR/train/<class>/<index>.npy`` and ``OUT_DIR/test/<class>/<index>.npy`` (float32 feature vectors,
standardized with the train split's statistics): a stand-in for your own files, e.g. one exported per record.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from wine_plugin import load_wine_arrays  # this folder's plugin: run the script from anywhere, by its path


def write_wine_files(out: Path, seed: int = 0) -> int:
    """Write the class folders under ``out``; returns the number of files."""
    arrays = load_wine_arrays(None, seed)
    names = ("class_0", "class_1", "class_2")  # sklearn's wine.target_names
    count = 0
    for split, x, y in (("train", arrays.x_train, arrays.y_train), ("test", arrays.x_test, arrays.y_test)):
        for i, (features, label) in enumerate(zip(x, y, strict=True)):
            folder = out / split / names[int(label)]
            folder.mkdir(parents=True, exist_ok=True)
            np.save(folder / f"{i:04d}.npy", features.astype(np.float32))
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory to write train/ and test/ into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    args = parser.parse_args()
    print(f"wrote {write_wine_files(args.out, args.seed)} files to {args.out}")


if __name__ == "__main__":
    main()
