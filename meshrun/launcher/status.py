"""``meshrun status``: the live membership of a job, read from its rendezvous store.

    meshrun status --rdzv-backend etcd --rdzv-endpoint HOST:2379 --rdzv-id JOB [--rdzv-conf ...]

Prints the job's round, restart count and status, the nodes of the running round with their
node ranks (from ``r<round>/closed``) and whether each is alive (etcd: the node's lease and the
seconds since its last keep-alive; c10d: its heartbeat counter sampled twice, a moment apart),
each rank's recent step and busy time (``r<round>/steps/<node rank>``, for ranks that beat),
and the nodes waiting to join the next round. It only reads: on etcd it joins no lease, so
looking never keeps a finished job's keys alive; on c10d it connects as a client of the
agent-hosted store (``is_host=False``).

A job started with a shared secret (``--rdzv-conf secret_file=PATH`` or
``MESHRUN_RDZV_SECRET``) is read with the same secret: values that fail its check are ignored.

Exit codes: 0 printed; 1 no such job (``no job <id> at <endpoint>``); 2 usage; 3 the store
cannot be reached or refused us. torch is imported for c10d only (TCPStore), never for etcd.
"""

from __future__ import annotations

import time
from dataclasses import replace

import click

from meshrun.exits import EXIT_NO_JOB, EXIT_RENDEZVOUS
from meshrun.launcher.errors import ConfigError
from meshrun.launcher.values import ValueProblem, parse_rdzv_backend, parse_rdzv_conf

STATUS_READ_TIMEOUT = 5.0  # seconds, unless --rdzv-conf read_timeout= says otherwise


@click.command(
    "status",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    help="Show the live membership of a running job: round, restarts, nodes, waiting nodes. "
         "Exit status: 0 shown; 1 no such job at that endpoint; 2 bad options; 3 the store "
         "refused or did not answer.",
)
@click.option("--rdzv-backend", "--rdzv_backend", "backend", required=True,
              help="etcd (etcd-v3) or c10d (static: the TCPStore at MASTER_ADDR:MASTER_PORT).")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "endpoint", required=True,
              help="The etcd member(s), comma-separated, or the c10d store's HOST:PORT.")
@click.option("--rdzv-id", "--rdzv_id", "run_id", required=True, help="The job's --rdzv-id.")
@click.option("--rdzv-conf", "--rdzv_conf", "conf_text", default="",
              help="read_timeout=SECONDS; secret_file=PATH (or MESHRUN_RDZV_SECRET) for a job "
                   "with a shared secret; for etcd cacert/cert/key/user/password_file "
                   "(or MESHRUN_ETCD_PASSWORD)/insecure.")  # fmt: skip
def status(backend: str, endpoint: str, run_id: str, conf_text: str) -> int:
    from meshrun.rendezvous import RendezvousError

    backend, conf = parse_store_options(backend, conf_text)
    from meshrun.rendezvous.protocol import job_prefix

    prefix = job_prefix(run_id)
    try:
        store, settings = open_job_store(backend, endpoint, conf, run_id)
        try:
            lines = describe(store, prefix, backend, settings.keep_alive_interval)
            if getattr(store, "rejected", False):  # what it read was not sealed by this secret
                raise RendezvousError(
                    f"the values of job {run_id} are not sealed with this secret: give the "
                    "job's own secret_file (or MESHRUN_RDZV_SECRET)"
                )
        finally:
            store.close()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except RendezvousError as e:
        click.echo(f"meshrun status: error: {' '.join(str(e).split())}", err=True)
        return EXIT_RENDEZVOUS
    if lines is None:
        click.echo(f"no job {run_id} at {endpoint}", err=True)
        return EXIT_NO_JOB
    click.echo(f"job {run_id} at {endpoint} ({backend})")
    for line in lines:
        click.echo(line)
    return 0


def open_settings(conf: dict, run_id: str):
    """The rendezvous settings a client of a job's store needs (`STATUS_READ_TIMEOUT` unless
    ``read_timeout`` is given), and the job's shared secret (None without one).

    Raises:
        ConfigError: a bad ``--rdzv-conf`` value or secret.
    """
    from meshrun.rendezvous import settings_from_conf
    from meshrun.rendezvous.auth import load_secret

    try:
        settings = settings_from_conf(conf, run_id=run_id, min_nodes=1, max_nodes=2, max_restarts=0)
        if "read_timeout" not in conf:
            settings = replace(settings, read_timeout=STATUS_READ_TIMEOUT)
        return settings, load_secret(settings.extra)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_store_options(backend: str, conf_text: str) -> tuple[str, dict]:
    """``--rdzv-backend`` and ``--rdzv-conf`` of ``meshrun status`` and ``meshrun stacks``:
    the backend's canonical name and the conf as a dict. A key nobody reads is said on stderr
    and ignored, as the launcher does.

    Raises:
        ConfigError: either is malformed (one line naming the option).
    """
    given = backend.strip().lower()
    try:
        backend = parse_rdzv_backend(backend)
    except ValueProblem as e:
        raise e.at(f"--rdzv-backend {backend}") from None
    try:
        conf, notes = parse_rdzv_conf(conf_text, given if given == "etcd-v2" else backend)
    except ValueProblem as e:
        raise e.at(f"--rdzv-conf {conf_text}") from None
    for note in notes:
        click.echo(note, err=True)
    return backend, conf


def open_job_store(backend: str, endpoint: str, conf: dict, run_id: str):
    """A client of the job's rendezvous store (never its host, holding no lease), through the
    job's shared secret when it has one; returns ``(store, settings)``.

    Raises:
        ConfigError: a bad ``--rdzv-conf`` value or secret.
        RendezvousError: the store cannot be reached.
    """
    settings, secret = open_settings(conf, run_id)
    store = _open(backend, endpoint, settings)
    if secret is not None:
        from meshrun.rendezvous.auth import AuthenticatedStore

        store = AuthenticatedStore(store, secret, run_id)
    return store, settings


def _open(backend: str, endpoint: str, settings):
    if backend == "etcd":
        from meshrun.rendezvous.etcd import open_etcd_store

        return open_etcd_store(endpoint, settings, job_lease=False)
    from meshrun.rendezvous import c10d

    host, port = c10d.parse_endpoint(endpoint, 29500 if backend == "static" else c10d.DEFAULT_PORT)
    _listening(host, port)
    return c10d.TCPStoreBackend(host, port, is_host=False, timeout=settings.read_timeout)


def _listening(host: str, port: int) -> None:
    """Say at once when nothing listens at the c10d store's address (the job has ended, or the
    endpoint is wrong), rather than after TCPStore's own connect timeout.

    Raises:
        StoreLostError: the connection was refused or the host cannot be reached.
    """
    import socket

    from meshrun.rendezvous.api import StoreLostError
    from meshrun.rendezvous.c10d import check_resolves

    check_resolves(host, port, "the rendezvous store")
    try:
        socket.create_connection((host.strip("[]"), port), timeout=STATUS_READ_TIMEOUT).close()
    except OSError as e:
        raise StoreLostError(
            f"nothing answers at {host}:{port} ({e.strerror or e}): the job has finished, or "
            "the endpoint is not its --rdzv-endpoint"
        ) from None


def describe(store, prefix: str, backend: str, keep_alive_interval: float) -> list[str] | None:
    """The lines ``meshrun status`` prints for the job under ``prefix``; None: no such job."""
    from meshrun.rendezvous.api import decode_members
    from meshrun.rendezvous.protocol import JobState, closed_key, nodes_key, state_key

    item = store.get(state_key(prefix))
    if item is not None:
        state = JobState.from_json(item.value)
    elif store.count(nodes_key(prefix, 0)) > 0:
        state = JobState()  # round 0: the state is first written when it changes
    else:
        return None
    lines = [f"round {state.round}, restart count {state.restarts}, status {state.status}"]
    if state.reason:
        lines.append(f"last change: {state.reason}")
    closed = store.get(closed_key(prefix, state.round))
    if closed is None:
        joined = store.count(nodes_key(prefix, state.round))
        lines.append(f"round {state.round} is open: {joined} node(s) joined so far")
    else:
        members = decode_members(closed.value)
        alive = _liveness(store, backend, [m.node_id for m in members], keep_alive_interval)
        lines.append(f"nodes ({len(members)}):")
        for rank, m in enumerate(members):
            lines.append(
                f"  node rank {rank}: {m.node_id}  addr {m.addr}  nproc {m.nproc}  "
                f"{alive[m.node_id]}"
            )
        lines.extend(_step_times(store, prefix, state.round, len(members)))
    waiting = store.count(nodes_key(prefix, state.round + 1))
    lines.append(f"waiting: {waiting} node(s) for round {state.round + 1}")
    return lines


def _step_times(store, prefix: str, round: int, num_nodes: int) -> list[str]:
    """Each rank's recent step time and busy time (what the straggler check sees; published by
    every node's agent every `publish_interval`: 2 s, longer past 32 nodes), or nothing before
    the first steps. A rank whose waits meshrun.parallel does not count (torch's DDP) gets its
    busy time from the arrivals published with them (`arrival_waits`)."""
    from meshrun.agent.stragglers import (
        arrival_waits,
        decode_arrivals,
        decode_step_times,
        with_arrival_waits,
    )
    from meshrun.rendezvous.protocol import steps_key

    times, arrivals = {}, {}
    for node_rank in range(num_nodes):
        item = store.get(steps_key(prefix, round, node_rank))
        if item is None:
            continue
        try:
            node_times, node_arrivals = decode_step_times(item.value), decode_arrivals(item.value)
        except ValueError:
            continue  # a malformed value: that node's ranks are left out
        times.update(node_times)
        arrivals.update(node_arrivals)
    if not times:
        return []
    times = with_arrival_waits(times, arrival_waits(arrivals))  # ranks no counter timed
    lines = ["step times (median of recent steps; busy = not waiting for peers):"]
    for rank, t in sorted(times.items()):
        lines.append(
            f"  rank {rank}: step {t.step_s * 1e3:.1f} ms, busy {t.busy_s * 1e3:.1f} ms, "
            f"{t.steps} steps"
        )
    return lines


def _liveness(store, backend: str, node_ids: list[str], interval: float) -> dict[str, str]:
    if backend == "etcd":
        out = {}
        for node_id in node_ids:
            ttl = store.liveness_of(node_id)
            if ttl == "joining":
                out[node_id] = "joining (has not beaten yet: lost if it never does)"
            elif ttl is None or ttl[0] <= 0:
                out[node_id] = "lost (its lease expired)"
            else:
                remaining, granted = ttl
                out[node_id] = f"alive (last seen {max(0, granted - remaining)} s ago)"
        return out
    from meshrun.rendezvous.c10d import LIVENESS_PREFIX

    keys = [LIVENESS_PREFIX + node_id for node_id in node_ids]  # CounterLiveness on TCPStore
    before = [store.add(k, 0) for k in keys]
    wait = max(1.0, 2 * interval)
    time.sleep(wait)
    after = [store.add(k, 0) for k in keys]
    return {
        node_id: "alive" if b != a else f"lost (no heartbeat in {wait:g} s)"
        for node_id, b, a in zip(node_ids, before, after, strict=True)
    }
