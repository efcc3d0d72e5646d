#!/usr/bin/env bash
# Run tests/cuda (the strategies and the example on CUDA with nccl) on a machine with GPUs.
#
#   tests/cuda/run.sh                # from anywhere; uses ./.venv of the repository
#   PY=python3.12 TIMEOUT=1800 tests/cuda/run.sh -k example
#
# Sets up the venv as the Makefile does (`make install`), except torch: the Makefile pins the
# CPU wheel (torch==2.13.0), which must not land here. torch with CUDA must already be
# importable by the venv: create it with --system-site-packages over a CUDA torch
# (VENV_ARGS=--system-site-packages), or install the CUDA wheel into .venv yourself first
# (pip install torch --index-url https://download.pytorch.org/whl/cu128, say). The script
# stops with a message when torch is missing or torch.cuda.is_available() is False.
# Extra arguments go to pytest. Exit status: pytest's (124: ran past TIMEOUT seconds).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY="${PY:-python3}"
VENV="${VENV:-.venv}"
VPY="$VENV/bin/python"
TIMEOUT="${TIMEOUT:-1200}"

if [ ! -x "$VPY" ]; then
    echo "run.sh: creating $VENV ($PY -m venv ${VENV_ARGS:-})"
    # shellcheck disable=SC2086
    "$PY" -m venv ${VENV_ARGS:-} "$VENV"
    "$VPY" -m pip install --quiet --upgrade pip
fi

if ! "$VPY" -c "import torch" 2>/dev/null; then
    echo "run.sh: torch is not importable from $VPY. Install a CUDA build of torch into it" \
         "first (not the Makefile's CPU pin), or recreate it with" \
         "VENV_ARGS=--system-site-packages over a system CUDA torch." >&2
    exit 2
fi
if ! "$VPY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    "$VPY" -c "import torch; print(f'run.sh: torch {torch.__version__} (CUDA build: ' \
        f'{torch.version.cuda}) sees no GPU: torch.cuda.is_available() is False')" >&2
    echo "run.sh: tests/cuda needs torch with CUDA and a visible GPU; stopping." >&2
    exit 2
fi
"$VPY" -c "import torch; n = torch.cuda.device_count(); print(f'run.sh: torch ' \
    f'{torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s): ' \
    + ', '.join(torch.cuda.get_device_name(i) for i in range(n)))"

# the project and its test extras, as `make install` does, leaving the CUDA torch alone
# (pip keeps an installed torch that satisfies the project's range; numpy beside it, as there)
"$VPY" -m pip install --quiet numpy
"$VPY" -m pip install --quiet -e '.[test]'
if ! "$VPY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "run.sh: installing the project replaced torch with a build without CUDA;" \
         "reinstall the CUDA build of torch into $VENV and run again." >&2
    exit 2
fi

LOG="$(mktemp -t meshrun-cuda-tests.XXXXXX)"
echo "run.sh: pytest -q tests/cuda $* (timeout ${TIMEOUT}s; full log: $LOG)"
status=0
timeout --signal=TERM --kill-after=30 "$TIMEOUT" \
    "$VPY" -m pytest -q -rA tests/cuda "$@" 2>&1 | tee "$LOG" || status=${PIPESTATUS[0]}

echo
echo "==================== tests/cuda summary ===================="
grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$LOG" || true
tail -n 1 "$LOG"
if [ "$status" -eq 124 ]; then
    echo "run.sh: pytest ran past ${TIMEOUT}s and was stopped (TIMEOUT=... to change)"
elif [ "$status" -ne 0 ]; then
    echo "run.sh: pytest exited $status"
else
    echo "run.sh: all selected tests/cuda tests passed or were skipped"
fi
exit "$status"
