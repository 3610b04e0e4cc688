"""`fast-track stale`: which records a source edit staled, and each refreshing command once."""

import json

from ..cli import main
from .conftest import KERNEL, MODEL

PARITY = f"{MODEL}/evidence/h200/parity.json"


def test_fresh_then_stale_with_the_command_that_refreshes_it(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo.root)
    assert main(["stale"]) == 0
    assert capsys.readouterr().out == "every evidence record is fresh\n"
    path = repo.root / KERNEL
    path.write_text(path.read_text() + "\n# a later edit\n")
    assert main(["stale"]) == 1
    out = capsys.readouterr().out
    command = json.loads((repo.root / PARITY).read_text())["command"]
    assert f"  {PARITY}: stale" in out and f"({KERNEL})" in out
    assert out.count(f"  {command}\n") == 1 and "command(s) refresh them:" in out
