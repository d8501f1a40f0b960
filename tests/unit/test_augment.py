"""The augmentation pipeline (dosa/offload/augment.py), the dataset specs and the service framing:
pure functions, no services, no privilege."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from dosa.errors import DosaError
from dosa.offload import protocol
from dosa.offload.augment import AugmentConfig, BatchPipeline, augment_batch, make_pipeline
from dosa.offload.datasets import Split, load_dataset

DS = "digits:size=16,channels=2"


@pytest.fixture(scope="module")
def train():
    return load_dataset(DS).train


def test_upscaled_digits_are_deterministic_images():
    a, b = load_dataset(DS), load_dataset.__wrapped__(DS)
    assert a.train.x.shape[1:] == (2, 16, 16) and a.train.x.dtype == np.uint8
    assert np.array_equal(a.train.x, b.train.x) and np.array_equal(a.val.y, b.val.y)
    assert len(a.train) + len(a.val) == 1797 and a.classes == 10


def test_same_seed_epoch_batch_gives_identical_batch_regardless_of_history(train):
    p1 = BatchPipeline(train, 32, seed=7, augment=AugmentConfig())
    p2 = BatchPipeline(train, 32, seed=7, augment=AugmentConfig())
    for _ in p1.iter_epoch(1):  # p1 has computed the whole epoch, p2 nothing
        pass
    for b in (5, 0, len(p1) - 1):
        x1, y1, i1 = p1.batch(1, b)
        x2, y2, i2 = p2.batch(1, b)
        assert x1.dtype == np.float32
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2) and np.array_equal(i1, i2)


def test_epochs_and_seeds_change_order_and_draws(train):
    p = BatchPipeline(train, 32, seed=7, augment=AugmentConfig())
    q = BatchPipeline(train, 32, seed=8, augment=AugmentConfig())
    assert not np.array_equal(p.batch(0, 0)[2], p.batch(1, 0)[2])
    assert not np.array_equal(p.batch(0, 0)[2], q.batch(0, 0)[2])


def test_an_epoch_visits_every_sample_exactly_once(train):
    p = BatchPipeline(train, 50, seed=1, augment=AugmentConfig())
    ids = np.concatenate([b[2] for b in p.iter_epoch(3)])
    assert np.array_equal(np.sort(ids), np.arange(len(train)))
    assert len(p) == -(-len(train) // 50)
    assert len(BatchPipeline(train, 50, 1, AugmentConfig(), drop_last=True)) == len(train) // 50


def test_crop_is_a_window_of_the_zero_padded_image(train):
    cfg = AugmentConfig(crop_padding=3, flip=False, noise_std=0.0, normalize=False)
    x = train.x[:40]
    out = augment_batch(x, cfg, np.random.default_rng(5), np.zeros(2, np.float32), np.ones(2, np.float32))
    rng = np.random.default_rng(5)
    oy, ox = rng.integers(0, 7, 40), rng.integers(0, 7, 40)
    padded = np.pad(x.astype(np.float32) / 255, ((0, 0), (0, 0), (3, 3), (3, 3)))
    for i in range(40):  # per-sample reference, test only
        np.testing.assert_allclose(out[i], padded[i, :, oy[i]:oy[i] + 16, ox[i]:ox[i] + 16], rtol=1e-6)
    assert len({(a, b) for a, b in zip(oy, ox)}) > 10  # offsets really vary


def test_flip_mirrors_about_half_the_batch(train):
    cfg = AugmentConfig(crop_padding=0, flip=True, noise_std=0.0, normalize=False)
    x = train.x[:200]
    out = augment_batch(x, cfg, np.random.default_rng(0), np.zeros(2, np.float32), np.ones(2, np.float32))
    base = x.astype(np.float32) * np.float32(1 / 255)  # the pipeline scales by multiplying
    same = np.all(out == base, axis=(1, 2, 3))
    mirrored = np.all(out == base[..., ::-1], axis=(1, 2, 3))
    assert np.all(same | mirrored)
    assert 60 < int((mirrored & ~same).sum()) < 140


def test_noise_and_normalization_statistics(train):
    p = make_pipeline(DS, "train", 256, 0, None)  # evaluation: normalization only
    x = np.concatenate([b[0] for b in p.iter_epoch(0)])
    np.testing.assert_allclose(x.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(x.std(axis=(0, 2, 3)), 1, atol=1e-3)
    cfg = AugmentConfig(crop_padding=0, flip=False, noise_std=0.1, normalize=False)
    z = np.zeros((64, 1, 32, 32), np.uint8)
    noise = augment_batch(z, cfg, np.random.default_rng(0), np.zeros(1, np.float32), np.ones(1, np.float32))
    assert abs(float(noise.mean())) < 0.005 and abs(float(noise.std()) - 0.1) < 0.005


@pytest.mark.parametrize("bad", [{"crop_padding": -1}, {"noise_std": -0.5}, {"rotate": 3}])
def test_bad_augment_config_is_a_clear_error(bad):
    with pytest.raises(DosaError):
        AugmentConfig.from_dict(bad)


@pytest.mark.parametrize("spec", ["", "imagenet", "digits:size=3", "digits:size=x", "digits:colour=1",
                                  "npz:", "npz:/nonexistent/file.npz"])
def test_bad_dataset_specs_are_clear_errors(spec):
    with pytest.raises(DosaError):
        load_dataset(spec)


def test_npz_dataset_from_disk(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x=rng.integers(0, 255, (30, 12, 12), dtype=np.uint8), y=rng.integers(0, 3, 30))
    ds = load_dataset(f"npz:{path}")
    assert ds.train.x.shape[1:] == (1, 12, 12) and len(ds.train) + len(ds.val) == 30
    np.savez(path, x=np.zeros((4, 2, 2)), y=np.zeros(5, dtype=np.int64))
    with pytest.raises(DosaError, match="labels"):
        load_dataset.__wrapped__(f"npz:{path}")


def _pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_protocol_roundtrip_keeps_names_dtypes_shapes_and_bytes():
    a, b = _pair()
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.arange(5, dtype=np.int64),
              "empty": np.zeros((0, 3), np.float64), "mask": np.array([True, False]),
              "big_endian": np.arange(3, dtype=">i4")}
    protocol.send_message(a, "batch", {"index": 3}, arrays)
    msg = protocol.recv_message(b)
    assert msg.kind == "batch" and msg.meta == {"index": 3}
    for k, v in arrays.items():
        assert msg.arrays[k].shape == v.shape and np.array_equal(msg.arrays[k], v)
    a.close()
    with pytest.raises(protocol.ConnectionClosed):
        protocol.recv_message(b)


def test_protocol_refuses_object_arrays():
    with pytest.raises(protocol.FrameError):
        protocol.encode_header("x", {}, {"o": np.array([object()])})


def _raw(head_magic=protocol.MAGIC, version=protocol.VERSION, header=b"{}", payload=b"", plen=None):
    return protocol.HEAD.pack(head_magic, version, len(header),
                              len(payload) if plen is None else plen) + header + payload


@pytest.mark.parametrize("raw", [
    _raw(head_magic=b"XXXX"),
    _raw(version=9),
    struct.pack("!4sB3xII", protocol.MAGIC, 1, protocol.MAX_HEADER + 1, 0),
    _raw(header=b"not json"),
    _raw(header=b'{"kind":"x","arrays":[{"name":"a","dtype":"|O","shape":[1]}]}', payload=b"\0" * 8),
    _raw(header=b'{"kind":"x","arrays":[{"name":"a","dtype":"<f4","shape":[4]}]}', payload=b"\0" * 8),
    _raw(header=b'{"kind":"x","arrays":[{"name":"a","dtype":"<f4","shape":[-1]}]}'),
], ids=["magic", "version", "huge-header", "json", "pickle-dtype", "length-mismatch", "negative-shape"])
def test_protocol_rejects_malformed_messages(raw):
    a, b = _pair()
    a.sendall(raw)
    with pytest.raises(protocol.FrameError):
        protocol.recv_message(b)


def test_bad_pipeline_arguments_are_clear_errors(train):
    with pytest.raises(DosaError):
        BatchPipeline(train, 0, 0, AugmentConfig())
    with pytest.raises(DosaError):
        BatchPipeline(Split(train.x[:0], train.y[:0]), 4, 0, AugmentConfig())
    with pytest.raises(DosaError):
        BatchPipeline(train, 8, 0, AugmentConfig()).batch(0, 10_000)


def test_parallel_producer_keeps_batch_order_and_bits():
    from concurrent.futures import ThreadPoolExecutor
    from dpu_fw.offload.service import Producer, _DONE
    pipe = make_pipeline(DS, "train", 40, 9, AugmentConfig())
    with ThreadPoolExecutor(3) as pool:
        producer = Producer(pipe, ("k",), epoch=4, start=2, prefetch=4, pool=pool, workers=3)
        got = []
        while (item := producer.get()) is not _DONE:
            assert not isinstance(item, Exception), item
            got.append(item)
        producer.close()
    assert [b for b, _ in got] == list(range(2, len(pipe)))
    fresh = make_pipeline(DS, "train", 40, 9, AugmentConfig())
    for b, (x, y, ids) in got:
        lx, ly, lids = fresh.batch(4, b)
        assert np.array_equal(x, lx) and np.array_equal(ids, lids)
