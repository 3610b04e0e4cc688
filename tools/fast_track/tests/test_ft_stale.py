"""`fast-track stale`: which records a source edit staled, and each refreshing command once."""

import json

from ..cli import main
from .conftest import KERNEL, MODEL, edit_code

PARITY = f"{MODEL}/evidence/h200/parity.json"


def test_fresh_then_stale_with_the_command_that_refreshes_it(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo.root)
    assert main(["stale"]) == 0
    assert capsys.readouterr().out == "every evidence record is fresh\n"
    edit_code(repo.root / KERNEL)
    assert main(["stale"]) == 1
    out = capsys.readouterr().out
    command = json.loads((repo.root / PARITY).read_text())["command"]
    assert f"  {PARITY}: stale" in out and f"({KERNEL})" in out
    assert out.count(f"  {command}\n") == 1 and "command(s) refresh them:" in out


def test_the_refresh_time_counts_a_shared_command_once_and_says_what_is_unknown(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo.root)
    record = json.loads((repo.root / PARITY).read_text())
    (repo.root / PARITY).write_text(json.dumps({**record, "wall_s": 42.4}))
    edit_code(repo.root / KERNEL)
    assert main(["stale"]) == 1
    lines = capsys.readouterr().out.splitlines()
    stale = int(lines[0].split()[0])
    took = [line for line in lines if line.startswith("their last runs took")]
    assert took and took[0].startswith("their last runs took 42 s")
    assert (f", and {stale - 1} record(s) do not say how long" in took[0]) == (stale > 1)


def test_the_refresh_time_is_split_by_the_folder_of_each_card(repo, monkeypatch, capsys):
    """Records of two cards' folders are made on two machines: each folder's count and seconds."""
    monkeypatch.chdir(repo.root)
    record = json.loads((repo.root / PARITY).read_text())
    (repo.root / PARITY).write_text(json.dumps({**record, "wall_s": 30.0}))
    repo.write(f"{MODEL}/evidence/h100/parity.json", json.dumps({**record, "wall_s": 12.0}))
    edit_code(repo.root / KERNEL)
    assert main(["stale"]) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("by folder: ")]
    assert line.startswith("by folder: h100 1 record(s), 12 s; h200 ")
    h200 = int(out.splitlines()[0].split()[0]) - 1
    assert f"h200 {h200} record(s), " in line


def test_a_file_that_is_not_a_record_is_listed_and_fails(repo, monkeypatch, capsys):
    """A corrupt file or a JSON without `kind` is evidence nobody can judge: not "all fresh"."""
    monkeypatch.chdir(repo.root)
    repo.write(f"{MODEL}/evidence/h200/broken.json", "{")
    repo.write(f"{MODEL}/evidence/h200/nokind.json", json.dumps({"results": []}))
    assert main(["stale"]) == 1
    out = capsys.readouterr().out
    assert "every evidence record is fresh\n" not in out
    assert "2 evidence file(s) hold no readable record" in out
    assert f"  {MODEL}/evidence/h200/broken.json: not readable as JSON" in out
    assert f"  {MODEL}/evidence/h200/nokind.json: not an evidence record (no `kind`)" in out
