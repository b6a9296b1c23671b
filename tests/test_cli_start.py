"""`symphony start` and `symphony kernel` failing or interrupted before they serve."""

import subprocess
import sys

from daemon import ROOT


def symphony(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symphony.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_a_failed_start_shows_only_its_own_kernels_log(tmp_path):
    """The log is appended to: a failed start echoed the errors of earlier failed starts
    before its own."""
    sock, state = tmp_path / "k.sock", tmp_path / "statefile"
    state.write_text("")
    first = symphony("start", "--socket", str(sock), "--state-dir", str(state))
    assert first.returncode == 1 and "statefile" in first.stderr, first.stderr
    second = symphony("start", "--socket", str(sock), "--state-dir", str(tmp_path / "st"),
                      "--model", str(tmp_path / "missing.gguf"))
    assert second.returncode == 1 and "missing.gguf" in second.stderr, second.stderr
    assert "statefile" not in second.stderr
