"""The CPU example runs as the README writes it: ``torchrun --standalone --nproc-per-node 2
examples/quickstart.py`` (2 gloo ranks), and so does the README's own code block, each within a
deadline; every call's result is checked inside them against torch.distributed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEADLINE_S = 240
COMMAND = "torchrun --standalone --nproc-per-node 2 examples/quickstart.py"

pytestmark = pytest.mark.slow


def _torchrun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``torchrun ARGS`` (as ``python -m torch.distributed.run``: the torchrun of this Python) from
    the repository root, with no user database, killed past the deadline."""
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOSYMM_DB=str(tmp_path / "none.sqlite"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return result


def test_the_readme_shows_the_example_command():
    assert f"\n{COMMAND}\n" in README.read_text()


def test_the_cpu_example_runs_as_written(tmp_path):
    result = _torchrun(COMMAND.split()[1:], tmp_path)
    out = result.stdout
    assert "all_reduce:         nccl - no tuned row" in out
    assert "all_reduce_rmsnorm: nccl_fused" in out and "computes the native-chain formula" in out
    assert "reduce_scatter_tensor, all_gather_into_tensor: equal to torch.distributed's" in out
    assert "convert_dp_to_ep, convert_ep_to_dp: every token's k rows back" in out


def test_the_readme_code_block_runs_as_written(tmp_path):
    """The README's first Python block (its "A first run" section) is a whole program."""
    text = README.read_text()
    section = text[text.index("## A first run"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)
    script = tmp_path / "first_run.py"
    script.write_text(code)
    result = _torchrun(["--standalone", "--nproc-per-node", "2", str(script)], tmp_path)
    assert result.stdout.count("nccl - no tuned row for this hardware/world size/shape") == 2  # each rank's explain
    assert "'nccl_fused': {'calls': 1" in result.stdout
