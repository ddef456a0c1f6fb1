#!/usr/bin/env bash
# The GPU-host benchmark in one command, without network access: installs
# what the host lacks from a wheel folder, makes its own data, prints one
# table (see driver.py for what it measures). About 7 minutes by default.
#
#   benchmarks/gpu_host/run.sh --wheels=/path/to/wheels [--out=DIR] [driver flags]
#   benchmarks/gpu_host/run.sh --quick                # tiny, any CPU, no install
#
# The wheel folder: on a machine with network access and this project
# installed, `python benchmarks/gpu_host/wheelhouse.py --dest=DIR` prints the
# `pip wheel` / `pip download` commands that fill it (grain_cells and the
# ~20 packages the host image lacks, CPython 3.12 manylinux x86_64, ~15 MB).
# Keep it outside the repository and pass its path.
#
# Environment: PYTHON (default python3), SITE (where the wheels go,
# default /tmp/gc-site).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
site="${SITE:-/tmp/gc-site}"
wheels=""
args=()
for arg in "$@"; do
  case "$arg" in
    --wheels=*) wheels="${arg#--wheels=}" ;;
    *) args+=("$arg") ;;
  esac
done

if [[ -n "$wheels" ]]; then
  shopt -s nullglob
  files=("$wheels"/*.whl)
  if (( ${#files[@]} == 0 )); then
    echo "run.sh: no .whl files in $wheels (see wheelhouse.py)" >&2
    exit 2
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "${files[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

missing="$("$python" - <<'PY'
import importlib.util
names = ["grain", "anndata", "h5py", "jax", "flax", "optax", "orbax.checkpoint",
         "ml_collections", "deflate", "absl", "scipy", "tqdm"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PY
)"
if [[ -n "$missing" ]]; then
  echo "run.sh: missing Python packages: $missing" >&2
  echo "  bring them as wheels: python benchmarks/gpu_host/wheelhouse.py" >&2
  exit 2
fi
exec "$python" "$here/driver.py" ${args[@]+"${args[@]}"}
