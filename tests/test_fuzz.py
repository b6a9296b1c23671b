"""The fuzz run of issue 13, briefly: random syscalls from root and unprivileged processes,
some killed mid-call, must give no EIO, no exception that is not an OSError, no traceback in
the kernel's log, no leaked page, and a kernel that stops cleanly and restarts
(bench/fuzz.py says what each check is; run it longer, or with other seeds, by hand)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SECONDS, WORKERS, SEED = 40, 5, 13


def test_fuzz_finds_nothing(model, tmp_path):
    summary = tmp_path / "fuzz.json"
    # Its own process group: on a timeout, its kernel and workers go with it.
    tool = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fuzz.py"), "--seconds", str(SECONDS),
         "--workers", str(WORKERS), "--seed", str(SEED), "--model", str(model),
         "--json", str(summary)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = tool.communicate(timeout=SECONDS + 400)
    except subprocess.TimeoutExpired:
        os.killpg(tool.pid, signal.SIGKILL)
        stdout, stderr = tool.communicate()
        pytest.fail(f"the fuzz run did not end:\n{stdout[-4000:]}\n{stderr[-4000:]}")
    if not summary.exists():
        pytest.fail(f"no summary (exit {tool.returncode}):\n{stdout[-4000:]}\n{stderr[-4000:]}")
    result = json.loads(summary.read_text())
    assert result["calls"] > 500, stdout[-4000:]  # it did fuzz
    if result["findings"]:
        pytest.fail(f"{len(result['findings'])} kinds of finding:\n"
                    f"{stdout[stdout.find('findings:'):][:20000]}")
    assert tool.returncode == 0, stdout[-4000:] + stderr[-4000:]
