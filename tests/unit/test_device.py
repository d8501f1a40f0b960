"""Devices by torch's rule (host_lib.device): "cuda" and the current "cuda:N" are one device, and
so are "cpu" and "cpu:0", wherever the host side compares a gradient's device with its state's.
No GPU here: CUDA's presence and current device are faked, and the CPU's indexed name, which torch
treats the same way, runs the encoder for real."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from host_lib.device import canonical_device, same_device
from host_lib.encoder import RoundEncoder

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA available with current device 1 (only the two calls the rule makes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_cuda_without_index_is_the_current_cuda_device(fake_cuda):
    assert canonical_device("cuda") == torch.device("cuda:1")
    assert canonical_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert canonical_device("cuda:0") == torch.device("cuda:0")  # an explicit index stays
    assert same_device("cuda", torch.device("cuda:1")) and same_device(torch.device("cuda"), "cuda:1")
    assert not same_device("cuda", "cuda:0") and not same_device("cuda", "cpu")


def test_without_cuda_the_name_is_left_for_torch_to_judge(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert canonical_device("cuda") == torch.device("cuda")


def test_cpu_and_meta_have_no_index():
    for name in ("cpu", "cpu:0", torch.device("cpu", 0), None):
        assert canonical_device(name) == torch.device("cpu") == torch.zeros(1, device=name or "cpu").device
    assert canonical_device("meta:0") == torch.zeros(1, device="meta:0").device
    assert same_device("cpu:0", "cpu")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_encoder_on_an_indexed_device_name_takes_that_devices_gradients(backend):
    """``RoundEncoder(device="cpu:0")`` refused a CPU gradient ("gradient is on cpu, the encoder's
    residual on cpu:0") exactly as ``device="cuda"`` refused a gradient on cuda:0."""
    g = torch.from_numpy(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    enc = RoundEncoder(1000, 0.05, 2, device="cpu:0", backend=backend)
    ref = RoundEncoder(1000, 0.05, 2, device="cpu", backend=backend)
    a, b = enc.encode(g.clone(), 10), ref.encode(g.clone(), 10)
    assert enc.device == torch.device("cpu") and len(a) > 0
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values, b.values)
