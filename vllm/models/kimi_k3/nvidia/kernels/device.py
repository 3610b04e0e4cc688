"""What the kernel launchers know about a CUDA device, read once per device, and the scratch they keep there.

| name | what it is |
| --- | --- |
| `facts(device)` | the device's `DeviceFacts`, read on first use and cached (a device without an index is the current one) |
| `DeviceFacts.arch` | the CuTe DSL target the launchers compile for, e.g. `sm_90a` |
| `DeviceFacts.sm_count` | streaming multiprocessors: the launchers size grids and splits by it |
| `DeviceFacts.scratch(key, make)` | tensors kept for the process under `key`, built by `make(device)` on first use and complete before any later launch reads them |

Scratch is never freed or reallocated: a captured CUDA graph holds its addresses. Launches that
share a key share the tensors, so they must never run at once: inside a step they are ordered on
one stream, or run on different lanes of the executor only with different keys
(`tests/test_lanes_scratch.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch


@dataclass
class DeviceFacts:
    device: torch.device
    arch: str
    sm_count: int
    _kept: dict[Hashable, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)

    def scratch(self, key: Hashable, make: Callable[[torch.device], tuple[torch.Tensor, ...]]
                ) -> tuple[torch.Tensor, ...]:
        """The tensors kept under `key` (name it after the kernel and the shape they serve)."""
        if key not in self._kept:
            self._kept[key] = make(self.device)
            # `make` fills them (zeroed counters) on the current stream, but the launch that reads
            # them may be on another (a lane of the executor): wait once, here, before any launch.
            # A capture may not wait; the launchers' contract (a shape runs once before it is
            # captured) keeps first builds out of captures
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(self.device)
        return self._kept[key]


_FACTS: dict[torch.device, DeviceFacts] = {}


def facts(device: torch.device) -> DeviceFacts:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _FACTS:
        major, minor = torch.cuda.get_device_capability(device)
        _FACTS[device] = DeviceFacts(device, f"sm_{major}{minor}a",
                                     torch.cuda.get_device_properties(device).multi_processor_count)
    return _FACTS[device]
