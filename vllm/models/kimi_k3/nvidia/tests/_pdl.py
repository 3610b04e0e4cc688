"""The PTX-order check shared by the compile tests of the kernels launched as PDL dependents."""

from __future__ import annotations

import re

GLOBAL_LOAD = re.compile(r"\b(?:ld|ldu)(?:\.[\w:]+)*\.global\b|\bcp\.async\b")
GLOBAL_WRITE = re.compile(r"\b(?:st|red|atom)(?:\.[\w:]+)*\.global\b|\bcp\.async\.bulk\.global")


def check_pdl_order(ptx: str, early_loads: int) -> None:
    """A PDL dependent of the step: dependents released first, then exactly `early_loads` global
    loads (the weights', constants of the graph), one `griddepcontrol.wait`, and only after it any
    other load or any write. An activation loaded before the wait could be the previous kernel's
    old output; a kernel that never waits could finish before the kernels it depends on."""
    assert ptx.count("griddepcontrol.wait") == 1
    released, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert not GLOBAL_LOAD.search(ptx[:released])
    assert len(GLOBAL_LOAD.findall(ptx[released:wait])) == early_loads, ptx[released:wait]
    assert not GLOBAL_WRITE.search(ptx[:wait])
