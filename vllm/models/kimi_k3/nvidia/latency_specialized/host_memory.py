"""The memory a run on this machine may fill, read before anything is loaded or drawn, so that the
command line refuses a config or a length that cannot fit with the sizes, instead of running out
of memory minutes later."""

from __future__ import annotations

import os

import torch

_UNITS = (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20))


def usable_memory(device: str, gpu_index: int | None = None) -> tuple[int, str] | None:
    """(bytes, what they are, in words), or None where they cannot be read. CUDA: one GPU's
    memory (`gpu_index`, else the current one); CPU: the host's available memory, which every rank
    of a CPU run shares (its physical memory where /proc/meminfo is missing)."""
    try:
        if device == "cuda":
            index = torch.cuda.current_device() if gpu_index is None else gpu_index
            props = torch.cuda.get_device_properties(index)
            return props.total_memory, f"the memory of one {props.name}"
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            return kib * 1024, "this host's available memory"
        except (OSError, StopIteration, ValueError, IndexError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"
    except (ValueError, OSError, AttributeError, RuntimeError, AssertionError):
        return None


def size_words(n: int) -> str:
    """A byte count in binary units, three significant digits."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"
