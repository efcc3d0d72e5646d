"""``--master-port P`` on one node: the workers' store listens on P, as torchrun's static
rendezvous does (it hosts a TCPStore on P and passes P through), so a script that names its
own store, ``init_process_group(init_method="tcp://localhost:P")``, meets there instead of
waiting for torch's 30-minute timeout on a port nobody listens on. The same test runs under
torchrun (``python -m torch.distributed.run``), the reference, and under meshrun."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(150)

SCRIPT = str(Path(__file__).parent / "scripts" / "tcp_init.py")
LAUNCHERS = {
    "meshrun": [sys.executable, "-m", "meshrun"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _records(path: Path) -> list[dict]:
    return sorted((json.loads(line) for line in path.read_text().splitlines()),
                  key=lambda r: int(r["RANK"]))  # fmt: skip


def _run(launch, command: list[str], args: list[str], env: dict[str, str] | None = None):
    """Run a launcher to its end (a liveness bound of 90 s: the hang this is about lasts 30
    minutes; the worker's own store timeout is 30 s)."""
    proc = launch.start(args, command=command, env=env)
    try:
        out, err = proc.communicate(timeout=90)
    except Exception:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{command[-1]} {args} did not finish in 90 s\n{out}\n{err}") from None
    return proc.returncode, out, err


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_tcp_init_method_on_the_given_master_port(launch, launcher):
    """torch's launcher test (test_run.py, ``tcp://localhost:P``): one node, two workers,
    ``--master-addr localhost --master-port P``: both finish, the all_reduce sums 2, and each
    worker sees MASTER_ADDR=localhost (the name given), MASTER_PORT=P, TORCHELASTIC_RUN_ID=none
    (torchrun's static backend passes --rdzv-id, default none)."""
    port, out = launch.free_port(), launch.cwd / "records.jsonl"
    code, _, err = _run(launch, LAUNCHERS[launcher], [
        "--nproc-per-node", "2", "--master-addr", "localhost", "--master-port", str(port),
        SCRIPT, "localhost", str(port), str(out)])  # fmt: skip
    assert code == 0, err
    records = _records(out)
    assert [r["RANK"] for r in records] == ["0", "1"], records
    for r in records:
        assert r["sum"] == 2
        assert (r["MASTER_ADDR"], r["MASTER_PORT"]) == ("localhost", str(port)), r
        assert r["TORCHELASTIC_RUN_ID"] == "none", r
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True", r
        # torchrun sets it in its own environment, so its workers inherit it
        assert r["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT", r


def test_pet_master_port_and_default_master_addr(launch):
    """PET_MASTER_PORT stands in for --master-port; --master-addr's default (127.0.0.1) is what
    the workers get, and a tcp:// group on 127.0.0.1:P meets there."""
    port, out = launch.free_port(), launch.cwd / "records.jsonl"
    code, _, err = _run(launch, LAUNCHERS["meshrun"], [
        "--nproc-per-node", "2", SCRIPT, "127.0.0.1", str(port), str(out)],
        env={"PET_MASTER_PORT": str(port)})  # fmt: skip
    assert code == 0, err
    records = _records(out)
    assert len(records) == 2 and {r["sum"] for r in records} == {2}, records
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records} == {("127.0.0.1", str(port))}


def test_master_addr_of_another_host_keeps_the_job_running(launch):
    """A --master-addr that is no address of this host (a name only a cluster's DNS knows, here
    TEST-NET-1's 192.0.2.1) on one node: the store listens on 127.0.0.1:P, the workers get
    MASTER_ADDR=127.0.0.1, and one note says so; the job runs as it did before P was honoured."""
    port, out = launch.free_port(), launch.cwd / "records.jsonl"
    code, _, err = _run(launch, LAUNCHERS["meshrun"], [
        "--nproc-per-node", "2", "--master-addr", "192.0.2.1", "--master-port", str(port),
        SCRIPT, "127.0.0.1", str(port), str(out)])  # fmt: skip
    assert code == 0, err
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in _records(out)} == {("127.0.0.1", str(port))}
    notes = [line for line in err.splitlines() if "192.0.2.1 is not an address of this host" in line]
    assert len(notes) == 1, err


def test_master_port_in_use_is_one_line_and_exit_3(launch):
    """A --master-port another process holds: nothing runs, one line names the port and the
    option, exit 3 (a store that cannot be hosted), within seconds."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = _run(launch, LAUNCHERS["meshrun"], [
            "--nproc-per-node", "2", "--master-port", str(port),
            SCRIPT, "127.0.0.1", str(port), "unused"])  # fmt: skip
    assert code == 3, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and f"port {port}" in lines[0] and "--master-port" in lines[0], err


def test_own_tcp_group_on_another_port_does_not_hang(launch):
    """Past torchrun 2.13: a script's own ``init_method="tcp://127.0.0.1:P2"`` on a port other
    than MASTER_PORT (a standalone job: MASTER_PORT is one the OS picked) meets there, rank 0
    hosting, as without a launcher. torch 2.13 makes every rank a client of P2 under the
    agent-store flag, so torchrun waits out the store timeout there (30 s in this script);
    meshrun's worker site honours the flag at MASTER_PORT only (upstream's fix, pytorch PR
    192113). env:// keeps reaching the agent's store (tests/agent/test_launch.py)."""
    port, out = launch.free_port(), launch.cwd / "records.jsonl"
    code, _, err = _run(launch, LAUNCHERS["meshrun"], [
        "--nproc-per-node", "2", SCRIPT, "127.0.0.1", str(port), str(out)])  # fmt: skip
    assert code == 0, err
    records = _records(out)
    assert len(records) == 2 and {r["sum"] for r in records} == {2}, records
    assert {r["MASTER_PORT"] for r in records} != {str(port)}
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in records} == {"True"}
