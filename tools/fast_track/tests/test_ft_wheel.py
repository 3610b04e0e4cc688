"""The wheel carries tools/fast_track as a namespace-rooted package and the `fast-track` script."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_wheel_ships_the_checker_and_it_imports_from_the_wheel_alone(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    package = {Path(n).name for n in names if n.startswith("tools/fast_track/")}
    expected = {p.name for p in (ROOT / "tools/fast_track").glob("*.py")}
    assert package == expected
    assert "tools/__init__.py" not in names  # `tools` stays a namespace
    assert not any(n.startswith("tools/fast_track/tests/") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "fast-track = tools.fast_track.cli:main" in archive.read(entry_points).decode()
    unpacked = tmp_path / "unpacked"
    archive.extractall(unpacked)
    # import from the unpacked wheel only, not from this checkout
    probe = ("import sys; sys.path = [p for p in sys.path if p not in ('', %r)]; "
             "sys.path.insert(0, %r); from tools.fast_track import cli; print(cli.__file__); "
             "sys.argv = ['fast-track', '--help']; cli.main()") % (str(ROOT), str(unpacked))
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith(str(unpacked))
    assert "record-sanitizer" in run.stdout
