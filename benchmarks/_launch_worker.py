"""Worker for benchmarks/launch.py (not a benchmark by itself).

Prints ``START rank=<r> attempt=<a> t=<time.time()>`` as its first line (before importing
torch: the issue's "first line"), joins a gloo process group through the launcher's ``env://``
contract, runs one all_reduce, then prints ``READY rank=<r> attempt=<a> t=<time.time()>`` (the
job is usable from then on).

``--fail``: on attempt 0 (``TORCHELASTIC_RESTART_COUNT == "0"``) rank 1 prints
``FAIL t=<time.time()>`` right after the all_reduce and exits 1, while rank 0 keeps "training"
(sleeps) until the launcher stops it; on later attempts every rank exits 0 after READY.
"""

import os
import sys
import time

T0 = time.time()
os.write(
    1,
    f"START rank={os.environ.get('RANK')} attempt={os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
    f"t={T0:.6f}\n".encode(),
)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TRACE = os.environ.get("LAUNCH_BENCH_TRACE") == "1"


def phase(what: str, t: float | None = None) -> None:
    """With LAUNCH_BENCH_TRACE=1: a timestamped phase line on stderr (for investigations)."""
    if TRACE:
        r, a = os.environ.get("RANK"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
        os.write(2, f"PHASE {what} rank={r} attempt={a} t={t or time.time():.6f}\n".encode())


def say(line: str) -> None:
    """One whole line in one write(2) on stdout: under ``python -u`` print() writes the text and
    the newline separately, and torchrun's workers share one stdout, so lines could interleave."""
    os.write(1, (line + "\n").encode())


def main() -> int:
    fail = "--fail" in sys.argv[1:]
    rank = int(os.environ["RANK"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    phase("python-started", T0)
    phase("torch-imported")
    dist.init_process_group("gloo")
    phase("pg-initialized")
    t = torch.ones(1)
    dist.all_reduce(t)
    if fail and attempt == "0" and rank == 1:
        say(f"FAIL rank={rank} attempt={attempt} t={time.time():.6f}")
        os._exit(1)
    say(f"READY rank={rank} attempt={attempt} t={time.time():.6f} sum={t.item():g}")
    if fail and attempt == "0":
        time.sleep(120)  # still "training" when rank 1 fails; the launcher must stop us
        return 0
    dist.destroy_process_group()
    phase("returning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
