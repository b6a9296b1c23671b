"""The command line against a real kernel: what a LIP says of its flags and of a kernel
that stops."""

import subprocess

import pytest
from daemon import ROOT, SYMPHONY


@pytest.mark.parametrize("lip", ["complete.py", "best_of_n.py"])
def test_a_lip_refuses_prompt_ids_outside_the_vocabulary(daemon, lip):
    """syscalls.flags.prompt_of's (and aprompt_of's) check: it was the kernel's "batch:
    token id outside the vocabulary", exit 1, naming no flag."""
    out = subprocess.run([*SYMPHONY, "run", f"lips/{lip}", "--prompt-ids", "1,-3,999"],
                         env=daemon.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.endswith("error: --prompt-ids: token -3 is outside [0, 320), the "
                               "vocabulary\n"), out.stderr
