"""Evidence records follow ARCHITECTURE.md §7 and hash exactly the sources they name."""

import json

from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import source_hash
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test

SOURCES = ["vllm/models/kimi_k3/nvidia/reference/ops.py", "vllm/models/kimi_k3/nvidia/tests/_evidence.py"]


def test_kernel_test_record_format(tmp_path, monkeypatch):
    results = [{"name": "a", "status": "pass", "rel_err": 1e-3}, {"name": "b", "status": "fail", "rel_err": 0.5}]
    monkeypatch.delenv("K3_EVIDENCE_DIR", raising=False)
    assert record_kernel_test("x.json", "demo", "tests/x.py", SOURCES, results, "all cases pass") is None
    monkeypatch.setenv("K3_EVIDENCE_DIR", str(tmp_path))
    assert record_kernel_test("x.json", "demo", "tests/x.py", SOURCES, [], "all cases pass") is None
    path = record_kernel_test("x.json", "demo", "tests/x.py", SOURCES, results, "all cases pass", extra={"bound": 1e-2})
    rec = json.loads(open(path).read())
    for key in ("kind", "family", "command", "gpu", "compute_capability", "driver", "versions", "commit",
                "sources", "source_hash", "results", "targets"):
        assert key in rec, key
    assert (rec["kind"], rec["family"]) == ("kernel-test", "demo")
    assert rec["source_hash"] == source_hash(SOURCES) and rec["sources"] == SOURCES
    assert rec["targets"] == [{"name": "all cases pass", "target": "all pass", "value": 0.5, "met": False}]
    assert rec["results"] == results and "tests/x.py" in rec["command"]
