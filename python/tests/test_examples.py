"""The README's Python example and the script ported from CoMLRL run as a user runs them, and
leave no temporary directory behind. (That the quickstart's setting learns is
test_package.py's `test_a_python_reward_function_is_trained_up`, the same config.)"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("troupe", reason="the troupe package is not installed (pip install .)")

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


@pytest.mark.parametrize("script, expected", [("quickstart.py", "held-out reward:"),
                                               ("port_from_comlrl.py", "held-out reward")])
def test_example_runs_and_cleans_up(tmp_path, script, expected):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--iterations", "1"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout, out.stdout
    assert os.listdir(tmp_path) == [], "temporary files left behind"
