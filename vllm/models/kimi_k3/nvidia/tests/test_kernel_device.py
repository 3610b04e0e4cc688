"""`kernels/device.py` on the CPU, with torch.cuda's device queries stubbed: facts are read once
per device (an index-less device is the current one), and scratch is built once per key,
waited for, and kept, separately per key."""

from types import SimpleNamespace

import pytest
import torch

from vllm.models.kimi_k3.nvidia.kernels import device as kdevice


@pytest.fixture
def two_gpus(monkeypatch):
    reads = []

    def capability(d):
        reads.append(d)
        return (9, 0) if d.index == 0 else (10, 3)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(multi_processor_count=132 if d.index == 0 else 148))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(kdevice, "_FACTS", {})
    return reads


def test_facts_are_read_once_per_device(two_gpus):
    f0 = kdevice.facts(torch.device("cuda", 0))
    assert (f0.arch, f0.sm_count) == ("sm_90a", 132)
    assert kdevice.facts(torch.device("cuda", 0)) is f0
    current = kdevice.facts(torch.device("cuda"))
    assert (current.device, current.arch, current.sm_count) == (torch.device("cuda", 1), "sm_103a", 148)
    assert kdevice.facts(torch.device("cuda", 1)) is current
    assert len(two_gpus) == 2


def test_scratch_is_built_once_per_key_and_kept(two_gpus, monkeypatch):
    dev = kdevice.facts(torch.device("cuda", 0))
    built = []
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: synced.append((len(built), d)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def make(n):
        def build(d):
            built.append((n, d))
            return (torch.full((n,), float(n)),)
        return build

    a = dev.scratch(("k", 4), make(4))
    assert dev.scratch(("k", 4), make(99)) is a  # kept: a captured graph points at it
    b = dev.scratch(("other", 4), make(8))
    assert b is not a and b[0].numel() == 8
    assert built == [(4, torch.device("cuda", 0)), (8, torch.device("cuda", 0))]
    # each build is waited for before it is handed out (its zeroing may be on another stream)
    assert synced == [(1, torch.device("cuda", 0)), (2, torch.device("cuda", 0))]
    assert kdevice.facts(torch.device("cuda", 1)).scratch(("k", 4), make(2))[0].numel() == 2  # per device
