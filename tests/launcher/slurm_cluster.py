"""A real SLURM cluster on this machine: a controller and two compute nodes, each a network
namespace on one bridge, for the tests that run meshrun the way SLURM users do.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (22.05) run unmodified:

- one namespace per host (``<tag>c`` the controller, ``<tag>n1`` and ``<tag>n2`` the nodes) on
  a bridge in the root namespace, addresses 10.215.X.{2,11,12}; each host's ``/etc/hosts`` is
  ``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it), with the ``::ffff:`` forms too, and
  each daemon runs under ``unshare --uts`` with its own host name;
- one ``munged`` with its own key and socket (the socket is a file: every namespace reaches
  it), named in ``slurm.conf`` by ``AuthInfo=socket=PATH``;
- ``slurm.conf`` in a temp dir (``SLURM_CONF`` tells every daemon and client), no accounting,
  ``SlurmUser=root``, ``TaskPlugin=task/none``, and the proctrack plugin the test asks for
  (``linuxproc`` signals every process of a step, ``pgid`` only its process group);
- short waits where SLURM's defaults are minutes: ``cred_expire=5`` (a requeued job may start
  again after 5 s, not 120), ``sched_interval=1``, and ``OverSubscribe=YES`` so a job that asks
  (``--oversubscribe``) shares nodes with another, as jobs do under select/cons_tres;
- slurmctld logs at ``debug2``, so a test can read when it last checked time limits (it sends
  ``--signal`` warnings only then, every 30 s: `SlurmCluster.next_limit_check`);
- clients (``sbatch``, ``squeue``, ``scancel``) run inside the controller's namespace.

Every name and port is unique to the fixture (the tag and the ports come from the pid and a
counter), so two clusters never collide; `SlurmCluster.stop` kills what it started (by pid)
and deletes the namespaces and the bridge, whatever happened.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "munged")
_made = itertools.count()


def missing() -> str | None:
    """Why a cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a SLURM cluster in namespaces needs root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "no `ip` or `unshare` command"
    absent = [p for p in PACKAGES if shutil.which(p) is None]
    if absent:
        return (f"SLURM is not installed ({', '.join(absent)} missing): apt-get install -y "
                "--no-install-recommends slurmctld slurmd slurm-client munge")  # fmt: skip
    return None


class SlurmCluster:
    """A controller and ``nodes`` compute nodes (2 CPUs each), started by `start`.

    Args:
        work: a fresh directory for the configuration, state, logs and job files.
        proctrack: "linuxproc" or "pgid" (SLURM's ``ProctrackType``).
        env: extra environment for the daemons (and so the jobs), e.g. PATH with meshrun.
    """

    def __init__(self, work: Path, proctrack: str = "linuxproc", nodes: int = 2,
                 env: dict[str, str] | None = None):  # fmt: skip
        n = next(_made)
        self.tag = f"mrs{os.getpid() % 1000}{n % 10}"
        net = 10 + (os.getpid() + 7 * n) % 240
        self.subnet = f"10.215.{net}"
        self.work = work
        self.proctrack = proctrack
        self.ctl = (f"{self.tag}c", f"{self.tag}ctl", f"{self.subnet}.2")  # ns, hostname, addr
        self.nodes = [(f"{self.tag}n{i}", f"{self.tag}node{i}", f"{self.subnet}.{10 + i}")
                      for i in range(1, nodes + 1)]  # fmt: skip
        self.bridge = f"{self.tag}b"
        base = 20000 + (os.getpid() * 7 + n * 101) % 20000
        self.ctl_port, self.node_port = base, base + 1
        self.env = {**os.environ, **(env or {}), "SLURM_CONF": str(work / "slurm.conf")}
        self._procs: list[subprocess.Popen] = []
        self._made_ns: list[str] = []
        self._ctl_started = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        """Make the network, write the configuration, start munged, slurmctld and slurmd, and
        wait until every node is idle. Raises RuntimeError (after `stop`) when it cannot."""
        try:
            self._network()
            self._config()
            self._munge()
            self._ctl_started = time.time()
            self._daemon(self.ctl, ["slurmctld", "-D", "-i"], "slurmctld.log")
            self._wait_port(self.ctl[2], self.ctl_port, timeout)
            for node in self.nodes:
                self._daemon(node, ["slurmd", "-D", "-N", node[1]], f"slurmd-{node[1]}.log")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
                states = dict(line.split() for line in out.splitlines() if line.strip())
                if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                    return
                time.sleep(0.2)
            raise RuntimeError(f"the nodes never became idle: {states}\n{self.logs()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill every daemon this cluster started (by pid, whole sessions), delete the
        namespaces and the bridge."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for ns in self._made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made_ns.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    # -- using it -------------------------------------------------------------------------------
    def run(self, argv: list[str], *, check: bool = True, timeout: float = 30):
        """A SLURM client command, inside the controller's namespace."""
        done = subprocess.run(["ip", "netns", "exec", self.ctl[0], *argv], env=self.env,
                              capture_output=True, text=True, timeout=timeout, cwd=self.work)  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr}")
        return done

    def sbatch(self, script: Path, *args: str) -> int:
        """Submit ``script``; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args, str(script)]).stdout.strip()
        return int(out.split(";")[0])

    def wait(self, job: int | str, timeout: float = 120) -> str:
        """Poll until job ``job`` (an id, or "ID_TASK" for an array task) has left the queue;
        returns its final state from ``scontrol`` (COMPLETED, FAILED, CANCELLED, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["squeue", "-h", "-j", str(job), "-o", "%T"], check=False).stdout
            if not out.strip():
                break
            time.sleep(0.25)
        else:
            raise AssertionError(f"job {job} still queued after {timeout} s\n{self.logs()}")
        fields = self.show(job)
        return fields.get("JobState", "UNKNOWN") + (f" {fields['ExitCode']}" if "ExitCode" in fields else "")

    def show(self, job: int | str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode "7:0", Restarts, ...)."""
        info = self.run(["scontrol", "-o", "show", "job", str(job)], check=False).stdout
        return dict(f.split("=", 1) for f in info.split() if "=" in f)

    def next_limit_check(self) -> float:
        """Seconds until slurmctld next checks time limits, the only moment it sends a job's
        ``--signal`` warning: every 30 s (PERIODIC_TIMEOUT, not configurable), counted from
        the last check in its log, else from its start."""
        last = self._ctl_started
        log = (self.work / "slurmctld.log").read_text(errors="replace")
        for stamp in re.findall(r"^\[([0-9T:.-]+)\] debug2: Testing job time limits", log, re.M):
            last = datetime.fromisoformat(stamp).timestamp()
        return max(0.0, last + 30 - time.time())

    def wait_running(self, job: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["squeue", "-h", "-j", str(job), "-o", "%T"], check=False).stdout
            if out.strip() == "RUNNING":
                return
            time.sleep(0.2)
        raise AssertionError(f"job {job} never ran\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.work.glob("*.log")))  # fmt: skip

    # -- helpers --------------------------------------------------------------------------------
    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        hosts = [self.ctl, *self.nodes]
        lines = ["127.0.0.1 localhost"]
        for _, name, addr in hosts:
            lines += [f"{addr} {name}", f"::ffff:{addr} {name}"]
        for i, (ns, _name, addr) in enumerate(hosts):
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text("\n".join(lines) + "\n")
            up, inside = f"{self.tag}u{i}", f"{self.tag}i{i}"
            _ip("link", "add", up, "type", "veth", "peer", "name", inside, "netns", ns)
            _ip("link", "set", up, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _config(self) -> None:
        w = self.work
        for d in ("state", "spool", "munge"):
            (w / d).mkdir(exist_ok=True)
        (w / "munge").chmod(0o755)  # the socket's directory: munge insists on 755
        nodes = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs=2 RealMemory=1000 State=UNKNOWN"
                          for _, name, addr in self.nodes)  # fmt: skip
        names = ",".join(name for _, name, _ in self.nodes)
        (w / "slurm.conf").write_text(f"""\
ClusterName={self.tag}
SlurmctldHost={self.ctl[1]}({self.ctl[2]})
SlurmctldPort={self.ctl_port}
SlurmdPort={self.node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={w / "munge" / "munge.socket"},cred_expire=5
CredType=cred/munge
StateSaveLocation={w / "state"}
SlurmdSpoolDir={w / "spool"}/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmctldDebug=debug2
SlurmdLogFile={w}/slurmd-%n.log
ProctrackType=proctrack/{self.proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/linear
MpiDefault=none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
""")
        (w / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _munge(self) -> None:
        w = self.work
        key = w / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        proc = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={w / 'munge' / 'munge.socket'}", f"--pid-file={w / 'munge' / 'munged.pid'}",
             f"--log-file={w / 'munged.log'}", f"--seed-file={w / 'munge' / 'munge.seed'}"],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._procs.append(proc)
        deadline = time.monotonic() + 10
        while not (w / "munge" / "munge.socket").exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"munged did not start\n{self.logs()}")
            time.sleep(0.05)

    def _daemon(self, host: tuple[str, str, str], argv: list[str], log: str) -> None:
        ns, name, _ = host
        shell = f"hostname {name} && exec {' '.join(argv)}"
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", shell],
            env=self.env, start_new_session=True, cwd=self.work,
            stdout=open(self.work / f"{log}.out", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._procs.append(proc)

    def _wait_port(self, addr: str, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        probe = ("import socket,sys; s=socket.socket(); s.settimeout(0.5); "
                 f"sys.exit(s.connect_ex(('{addr}', {port})))")  # fmt: skip
        while time.monotonic() < deadline:
            if subprocess.run(["ip", "netns", "exec", self.ctl[0], "python3", "-c", probe],
                              capture_output=True).returncode == 0:  # fmt: skip
                return
            time.sleep(0.1)
        raise RuntimeError(f"slurmctld never listened on {addr}:{port}\n{self.logs()}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


__all__ = ["SlurmCluster", "missing"]
