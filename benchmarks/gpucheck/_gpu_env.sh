# Sourced by the GPU-call scripts beside it: the repository root, $OUT, no preallocation, the installed site (set up
# once per machine: a warm machine keeps /tmp/ejk-site between calls).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ ! -d /tmp/ejk-site/ejkernel ]; then
  bash .ci/gpu setup > "$OUT/setup.log" 2>&1
  tail -n 5 "$OUT/setup.log"
fi
export PYTHONPATH=/tmp/ejk-site
