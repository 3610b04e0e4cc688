"""fast-track: review a model-local optimization against docs/fast_track/CHECKLIST.md.

Model-agnostic: it reads a model folder `vllm/models/<model>/<vendor>/` through its
SCOPE.yaml, its `kernels/` and `tests/` folders and its evidence JSON (ARCHITECTURE §7
format), and the git history of the repository; it imports nothing of the model.
`fast-track check` writes a markdown report, one ✓ / ✗ / needs-human line per checklist
item with the offending files and lines; `fast-track render-evidence` turns the evidence
JSON into the tables a reviewer reads; `fast-track record-coverage` turns a coverage.py
JSON report from a GPU run into an evidence record.
"""
