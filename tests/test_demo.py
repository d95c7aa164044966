"""The demo script."""

from __future__ import annotations


def test_the_demo_script_answers_help_without_setting_up(tmp_path):
    """``bash scripts/demo.sh --help`` prints its usage and installs nothing (a stand-in set-up script that
    leaves a mark is never run)."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    (tmp_path / "scripts" / "setup.sh").write_text(f"touch {tmp_path / 'ran'}\n")
    for flag in ("--help", "-h"):
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "demo.sh"), flag], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0 and "usage" in r.stdout and not (tmp_path / "ran").exists(), (r.stdout, r.stderr)
