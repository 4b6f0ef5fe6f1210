#!/usr/bin/env bash
# The checks of a lent GPU machine (docs/benchmarks.md#gpu_engine), prepared here, run there
# in one call.
#
#   bash deploy/gpu_check.sh wheels   # here: the wheels the GPU machine lacks, into .whl/
#   bash deploy/gpu_check.sh run      # there: install them into .site/, run every check
#   bash deploy/gpu_check.sh dry-run  # here: `run` on the CPU with only the GPU machine's
#                                     # packages importable, before device time is spent
#
# The GPU machine has torch (CUDA), triton, transformers, grpcio and pytest, no network, and
# not this project's other dependencies: `wheels` downloads those the checks import (the
# versions this checkout's .venv runs, built for GPU_PYTHON, 3.12 by default; the checks
# import no gRPC code). Carry `.whl` there (the device tool's `carry`). `run` installs them
# without network, then runs each check under its own time limit, its log under $OUT:
# the tests marked cuda, the engine benchmark at full size (decode steps at 1 / 32 / 128
# sequences, GPU busy share, tokens/s against transformers, kernels against SDPA), and the
# FlashInfer backend's run of it when flashinfer imports. Ray and Redis are not there: the
# serving path is measured on a GPU node of a cluster (benchmarks/serving_path.py).
# The limits (CUDA_TESTS_S 150, ENGINE_S 240, FLASHINFER_S 90) sum to 480 s: the device tool
# allows 600 s a call and a session about 15 minutes of device time, start-up included, so one
# `run` call (timeout_s 560) leaves time to rerun one check.
# Without CUDA `run` still runs (the tests skip, the benchmark runs its smoke size): `dry-run`
# does so with this .venv's python restricted to the packages the GPU machine has (torch,
# triton, transformers, grpcio, pytest and their requirements, linked into .gpu-sim/) and
# wheels for this python, so an import the GPU machine lacks fails here first.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHL=${WHL:-$ROOT/.whl}
SITE=${SITE:-$ROOT/.site}
SIM="$ROOT/.gpu-sim"
GPU_PYTHON=${GPU_PYTHON:-3.12}
# what the GPU machine has (with their requirements)
ON_GPU_MACHINE="torch triton transformers grpcio pytest"
# what the GPU machine lacks (top-level distributions; their own dependencies listed too,
# since wheels are installed without resolving)
CARRIED=(
  pydantic pydantic_core annotated-types typing-inspection redis gguf llguidance
  pytest-timeout hypothesis sortedcontainers attrs jsonschema jsonschema-specifications
  referencing rpds-py peft accelerate psutil prometheus-client
  matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six
)

wheels() {
  local py="$ROOT/.venv/bin/python" specs=()
  for dist in "${CARRIED[@]}"; do
    specs+=("$dist==$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist")")
  done
  rm -rf "$WHL" && mkdir -p "$WHL"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 -d "$WHL" "${specs[@]}"
  du -sh "$WHL"
}

run() {
  local py=${PYTHON:-python3}
  OUT=${OUT:-$ROOT/.gpu-out}
  mkdir -p "$OUT"
  rm -rf "$SITE"
  "$py" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHL"/*.whl \
    >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
  export PYTHONPATH="$ROOT:$SITE" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export KVCLUSTER_RESULTS_DIR="$OUT/results"
  local cuda engine_s=${ENGINE_S:-240}
  cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
  (nvidia-smi || true) >"$OUT/nvidia-smi.txt" 2>&1
  "$py" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1 | tee "$OUT/versions.txt"
  # shellcheck disable=SC2207
  local files=($(grep -rl "pytest.mark.cuda" tests --include='test_*.py' | sort))
  step cuda_tests "${CUDA_TESTS_S:-150}" "$py" -m pytest -q -m cuda -p no:cacheprovider "${files[@]}"
  if [ "$cuda" = 1 ]; then
    step gpu_engine "$engine_s" "$py" -m benchmarks.gpu_engine
    if "$py" -c "import flashinfer" 2>/dev/null; then
      step gpu_engine_flashinfer "${FLASHINFER_S:-90}" "$py" -m benchmarks.gpu_engine \
        --attn-backend flashinfer --skip-kernels --skip-transformers
    else
      echo "flashinfer: not importable here, its run skipped" | tee "$OUT/gpu_engine_flashinfer.log"
    fi
  else
    step gpu_engine "$engine_s" "$py" -m benchmarks.gpu_engine --smoke --skip-kernels
  fi
  grep -h "^rc=" "$OUT"/*.rc
}

# step NAME LIMIT_S CMD...: run CMD under LIMIT_S seconds, its output in $OUT/NAME.log and
# shown, its exit status in $OUT/NAME.rc
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "rc=${PIPESTATUS[0]} $name" | tee "$OUT/$name.rc"
}

dry_run() {
  rm -rf "$SIM" && mkdir -p "$SIM/site"
  "$ROOT/.venv/bin/python" - "$SIM/site" $ON_GPU_MACHINE <<'PY'
import importlib.metadata as md, re, sys
from pathlib import Path

dest, todo, seen = Path(sys.argv[1]), sys.argv[2:], set()
while todo:  # the distributions' requirement closure, extras left out
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    seen.add(name)
    todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r]
for name in seen:
    dist = md.distribution(name)
    for top in {f.parts[0] for f in dist.files or []}:
        src = Path(dist.locate_file(top))
        if src.exists() and not (dest / top).exists() and top not in ("..", "__pycache__"):
            (dest / top).symlink_to(src)
PY
  cat >"$SIM/python" <<SH
#!/usr/bin/env bash
# this .venv's python seeing only $SIM/site (pip: the whole .venv, to install the wheels)
if [ "\${1:-}" = -m ] && [ "\${2:-}" = pip ]; then exec "$ROOT/.venv/bin/python" "\$@"; fi
PYTHONPATH="\${PYTHONPATH:-}:$SIM/site" exec "$ROOT/.venv/bin/python" -S "\$@"
SH
  chmod +x "$SIM/python"
  local version
  version=$("$ROOT/.venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  WHL="$SIM/whl" GPU_PYTHON=$version wheels
  WHL="$SIM/whl" SITE="$SIM/carried" PYTHON="$SIM/python" OUT="$SIM/out" run
}

case "${1:-}" in
  wheels) wheels ;;
  run) run ;;
  dry-run) dry_run ;;
  *)
    echo "usage: bash deploy/gpu_check.sh wheels|run|dry-run" >&2
    exit 2
    ;;
esac
