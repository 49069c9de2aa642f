#!/usr/bin/env bash
# Run tests/stacks/ against the real vLLM 0.33.0 and SGLang 0.5.23 Python sources on this CPU.
#
# The wheels are fetched without their dependencies (pip download --no-deps) into the cache
# ($AUTOSYMM_STACKS_CACHE, default ~/.cache/autosymm-stacks; reused when present), their Python
# sources and metadata (no .so) are unpacked under $CACHE/src, and the pure-Python packages their
# modules import on a CPU are installed, pinned and without dependencies, under $CACHE/deps (the
# torch, triton and numpy of this environment stay the ones used). Compiled extensions that cannot
# load on a CPU are stubbed by name in tests/stacks/stubs.py. Exits 0 with the reason when the
# wheels cannot be fetched; otherwise pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
CACHE="${AUTOSYMM_STACKS_CACHE:-$HOME/.cache/autosymm-stacks}"
PYTHON="${PYTHON:-python3}"
# What the two stacks' Python modules import on a CPU, found by importing them; --no-deps, so
# each one's own imports are listed too (SGLang's beside vLLM's).
DEPS=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated_doc==0.0.7 anyio==4.11.0
  apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.1 frozenlist==1.8.0 h11==0.16.0
  httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 llguidance==1.9.1 msgspec==0.23.0
  multidict==7.2.1 openai==3.57.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pillow==13.0.0
  prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0
  safetensors==0.8.0 starlette==1.0.1 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.0
  truststore==0.10.5 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
  einops==0.8.2  # vllm.model_executor.layers.fused_moe's config (tests/stacks/test_moe_vllm.py)
  # SGLang's srt.utils and vLLM's config on a bare venv (found by importing them in .ci/run's venv)
  attrs==26.1.0 certifi==2026.10.19.post1 idna==3.20 ipython==9.18.1 orjson==3.13.0 pydantic==2.14.4
  pydantic_core==2.50.5 requests==2.34.2 sniffio==1.3.1 traitlets==5.16.1 typing_inspection==0.4.5
  urllib3==2.8.0 annotated_types==0.8.0 regex==2026.11.19 cloudpickle==3.1.3 py-cpuinfo==9.0.0
)

mkdir -p "$CACHE/src" "$CACHE/deps"
exec 9>"$CACHE/.lock"
flock 9  # one fetch / unpack / install at a time per cache
fetch() {  # fetch NAME VERSION: the wheel into $CACHE unless one is there
  local name=$1 version=$2
  if ! ls "$CACHE/$name-$version-"*.whl >/dev/null 2>&1; then
    if ! "$PYTHON" -m pip download -q --no-deps --dest "$CACHE" "$name==$version" >"$CACHE/download-$name.log" 2>&1; then
      echo "SKIP: cannot fetch the $name $version wheel (pip download --no-deps); see $CACHE/download-$name.log:"
      tail -3 "$CACHE/download-$name.log"
      exit 0
    fi
  fi
}
unpack() {  # unpack NAME VERSION: its Python sources and metadata into $CACHE/src, once
  local name=$1 version=$2 wheel marker
  wheel=$(ls "$CACHE/$name-$version-"*.whl | head -1)
  marker="$CACHE/src/.unpacked-$(basename "$wheel")"
  [ -e "$marker" ] && return
  "$PYTHON" - "$wheel" "$CACHE/src" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    zf.extractall(dest, [n for n in zf.namelist() if not n.endswith(".so") and ".so." not in n])
PY
  touch "$marker"
}
fetch vllm "$VLLM_VERSION"
fetch sglang "$SGLANG_VERSION"
unpack vllm "$VLLM_VERSION"
unpack sglang "$SGLANG_VERSION"

DEPS_MARKER="$CACHE/deps/.installed-$(printf '%s\n' "${DEPS[@]}" | sha256sum | cut -c1-16)"
if [ ! -e "$DEPS_MARKER" ]; then
  "$PYTHON" -m pip install -q --no-deps --upgrade --target "$CACHE/deps" "${DEPS[@]}"
  touch "$DEPS_MARKER"
fi

flock -u 9
export AUTOSYMM_STACKS_CACHE="$CACHE"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The versions and the files imported, as the tests import them (tests/stacks/stubs.py first);
# printed before the tests and again as the closing lines.
versions() {
  "$PYTHON" - <<'PY'
import sys
sys.path[:0] = ["tests/stacks"]
import stubs
stubs.use_real_sources()
import importlib.metadata as md, vllm, sglang
for mod in (vllm, sglang):
    print(f"{mod.__name__} {md.version(mod.__name__)} from {mod.__file__}")
print("stubbed (cannot load on a CPU):", ", ".join(sorted(stubs.STUBS)))
print("stand-ins (listed in tests/stacks/stubs.py STAND_INS):", ", ".join(sorted(stubs.STAND_INS)))
PY
}
versions
status=0
"$PYTHON" -m pytest -q tests/stacks/ "$@" || status=$?
echo "tests/stacks ran against (pytest status $status):"
versions
exit "$status"
