#!/usr/bin/env bash
# Build autosymm's sdist and wheel from this checkout (the wheel from the sdist, as `python -m
# build` does), install the wheel WITHOUT -e into a clean virtual environment, and check, from a
# folder outside the checkout, that the installed package imports, finds the shipped databases,
# explains a call from them and serves a one-rank gloo all_reduce. Exits non-zero on any failure.
#
#   bash scripts/check_wheel.sh [WORK_DIR]     (default: a fresh temporary folder, removed after)
#
# torch comes first, as in the README (pip's configuration decides the build: here the local CPU
# wheel; elsewhere add PyTorch's CPU index for the small one).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
[ -n "${1:-}" ] || trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip build
# A copy of the working tree's files (tracked, and untracked ones git does not ignore): build
# leftovers of an editable install (autosymm.egg-info's file list) must not fill gaps in the wheel.
mkdir "$work/src"
(cd "$repo" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$work/src"
"$py" -m build -q --outdir "$work/dist" "$work/src" >/dev/null
sdist=$(ls "$work"/dist/autosymm-*.tar.gz)
wheel=$(ls "$work"/dist/autosymm-*.whl)
tar tzf "$sdist" | grep -q "/tuning_db/.*\.sqlite$" || { echo "sdist lacks the shipped databases" >&2; exit 1; }
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q "$wheel"
cd "$work"   # outside the checkout: only the installed copy can be imported
AUTOSYMM_SRC="$work/src" "$py" - <<'PY'
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autosymm
from autosymm.db import store as db

installed = Path(autosymm.__file__).resolve()
assert "site-packages" in installed.parts, f"imported {installed}, not the installed wheel"
source = Path(os.environ["AUTOSYMM_SRC"]) / "autosymm"
packages = sorted(str(p.parent.relative_to(source.parent)) for p in source.rglob("__init__.py"))
missing = [pkg for pkg in packages if not (installed.parent.parent / pkg / "__init__.py").is_file()]
assert not missing, f"the wheel lacks the packages {missing}"
print(f"every package of the checkout is installed: {len(packages)}")
shipped = sorted(p.name for p in Path(db.shipped_db_dir()).glob("*.sqlite"))
assert shipped, f"no shipped database under {db.shipped_db_dir()}"
print(f"autosymm {installed.parent}; shipped databases: {', '.join(shipped)}")

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
dist.init_process_group("gloo", rank=0, world_size=1)
x = torch.arange(6, dtype=torch.float32)
autosymm.all_reduce(x)
assert torch.equal(x, torch.arange(6, dtype=torch.float32)), x
print("one-rank gloo all_reduce:", autosymm.explain(x).describe())
dist.destroy_process_group()
PY
out=$("$work/venv/bin/autosymm" explain --op all_reduce --bytes 1MiB --world-size 2 --gpu "NVIDIA H200")
echo "$out"
echo "$out" | grep -q "nvidia-h200-nvlink-x2.sqlite" || { echo "explain did not read the shipped database" >&2; exit 1; }
echo "wheel check passed: $(basename "$wheel")"
