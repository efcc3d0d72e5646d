"""``meshrun stacks``: every rank's current Python stack, across all nodes, in one screen.

    meshrun stacks --rdzv-backend etcd --rdzv-endpoint HOST:2379 --rdzv-id JOB [--rdzv-conf ...]
    meshrun stacks LOGDIR...

The job goes on: nothing is stopped. With a rendezvous store (a multi-node job, or an elastic
one, ``--nnodes 1:N``, also while it has one node), the command writes a request
(``stacks/request``, sealed like every value when the job has a shared secret) and each node's
agent, which looks for one every second, takes its running workers' stacks as
it does for a failure report (faulthandler where the script called ``meshrun.parallel.init()``,
else ``py-spy dump``; at most 2 s) and publishes them; the command waits for every member of the
running round (``--timeout`` seconds at most) and prints each rank's place (waiting in a
collective, or running: the likely cause of a stall), the innermost frame of its own code and
its main thread's innermost frames, with the likely culprit on top.

With log directories (a one-node job, ``--nnodes 1``, whose store lives inside its agent; or
any node, run on that node), the command reads the agents' ``events.jsonl`` for the running
round's worker pids and takes their stacks itself: it needs the right to signal the workers (the same user) and,
for py-spy, to ptrace them (root, or ``CAP_SYS_PTRACE`` where Yama's ptrace_scope is 1).

Exit codes: 0 printed (some nodes may not have answered: each is named); 1 no running job
found, or no node answered within ``--timeout``; 2 usage; 3 the store cannot be reached.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import click

from meshrun.exits import EXIT_NO_JOB, EXIT_RENDEZVOUS
from meshrun.launcher.errors import ConfigError


@click.command(
    "stacks",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    help="Print every rank's current Python stack, from the job's store or its log dirs.",
)
@click.argument("log_dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--rdzv-backend", "--rdzv_backend", "backend", default=None,
              help="etcd (etcd-v3) or c10d: the job's rendezvous backend.")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "endpoint", default=None,
              help="The etcd member(s), comma-separated, or the c10d store's HOST:PORT.")
@click.option("--rdzv-id", "--rdzv_id", "run_id", default=None, help="The job's --rdzv-id.")
@click.option("--rdzv-conf", "--rdzv_conf", "conf_text", default="",
              help="As the job's: secret_file, and for etcd the TLS and user options.")
@click.option("--timeout", type=click.FloatRange(0.5, 600), default=10.0, show_default=True,
              help="Seconds to wait for every node's answer.")  # fmt: skip
def stacks(log_dirs, backend, endpoint, run_id, conf_text, timeout) -> int:
    if log_dirs and (backend or endpoint or run_id):
        raise ConfigError("give log directories or --rdzv-backend/--rdzv-endpoint/--rdzv-id, "
                          "not both")  # fmt: skip
    if log_dirs:
        return _from_log_dirs(list(log_dirs))
    if not (backend and endpoint and run_id):
        raise ConfigError("give the job's --rdzv-backend, --rdzv-endpoint and --rdzv-id (a "
                          "multi-node job), or its log directory (one node)")
    return _from_store(backend, endpoint, run_id, conf_text, timeout)


# --- a multi-node job: ask the agents through the store ---------------------------------------


def _from_store(backend: str, endpoint: str, run_id: str, conf_text: str, timeout: float) -> int:
    from meshrun.agent.errors import WorkerFailure
    from meshrun.launcher.status import open_job_store, parse_store_options
    from meshrun.rendezvous import RendezvousError
    from meshrun.rendezvous.api import decode_members
    from meshrun.rendezvous.protocol import (
        JobState,
        closed_key,
        job_prefix,
        stacks_answer_key,
        stacks_answers_prefix,
        stacks_request_key,
        state_key,
    )

    backend, conf = parse_store_options(backend, conf_text)
    prefix = job_prefix(run_id)
    try:
        store, _ = open_job_store(backend, endpoint, conf, run_id)
        try:
            item = store.get(state_key(prefix))
            state = JobState.from_json(item.value) if item is not None else JobState()
            closed = store.get(closed_key(prefix, state.round))
            if closed is None or state.status != "running":
                click.echo(f"no running round of job {run_id} at {endpoint}", err=True)
                return EXIT_NO_JOB
            members = decode_members(closed.value)
            request = uuid.uuid4().hex[:12]
            key = stacks_request_key(prefix)
            current = store.get(key)
            value = json.dumps({"id": request, "round": state.round}).encode()
            store.compare_and_set(key, current.version if current else 0, value)
            keys = [stacks_answer_key(prefix, request, r) for r in range(len(members))]
            answers: dict[int, bytes] = {}
            deadline = time.monotonic() + timeout
            while len(answers) < len(keys) and time.monotonic() < deadline:
                for node_rank, k in enumerate(keys):
                    if node_rank not in answers and (got := store.get(k)) is not None:
                        answers[node_rank] = got.value
                time.sleep(0.2)
            store.delete_prefix(stacks_answers_prefix(prefix, request))
        finally:
            store.close()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except RendezvousError as e:
        click.echo(f"meshrun stacks: error: {' '.join(str(e).split())}", err=True)
        return EXIT_RENDEZVOUS
    records = []
    for node_rank in sorted(answers):
        try:
            records += [WorkerFailure.from_json(json.dumps(r)) for r in json.loads(answers[node_rank])]
        except (ValueError, TypeError):
            click.echo(f"meshrun stacks: node rank {node_rank} answered with a malformed value",
                       err=True)  # fmt: skip
    silent = [r for r in range(len(members)) if r not in answers]
    if not answers:  # nothing to print: say so, and fail (a script must not read "0 ranks")
        click.echo(f"meshrun stacks: no node of job {run_id} answered within {timeout:g} s "
                   f"(round {state.round}, {len(members)} node(s); is every agent meshrun's, "
                   f"and still running?)", err=True)
        return EXIT_NO_JOB
    title = f"job {run_id}: round {state.round}, {len(members)} node(s)"
    _print(title, records, [f"node rank {r} ({members[r].node_id})" for r in silent], timeout)
    return 0


# --- one node: read the workers' pids from the agents' event logs ------------------------------


def _from_log_dirs(log_dirs: list[Path]) -> int:
    import psutil

    from meshrun.agent.collectives import RECORD_FILE, read_record, summary
    from meshrun.agent.errors import WorkerFailure
    from meshrun.agent.events import EVENT_FILE
    from meshrun.agent.hang import progress_env, read_progress
    from meshrun.agent.stacks import Target, classify, collect_stacks

    files = []
    for d in log_dirs:
        if not d.exists():
            raise ConfigError(f"{d}: no such directory")
        found = [d] if d.is_file() else sorted(d.rglob(EVENT_FILE))
        # the directory the agent prints ("logs in .../attempt_N") or a rank's: its agent's log
        found = found or [p / EVENT_FILE for p in list(d.parents)[:2] if (p / EVENT_FILE).is_file()]
        files += found
    workers = []  # (agent dir, round, event) of each running worker
    for path in files:
        running = _running_workers(path)
        workers += [(path.parent, *w) for w in running]
    live = []
    for agent_dir, round_, event in workers:
        try:
            proc = psutil.Process(event["worker_pid"])
            if proc.create_time() > event["t"] + 1 or proc.status() == psutil.STATUS_ZOMBIE:
                continue  # the pid was reused, or the worker has exited
        except (psutil.Error, KeyError, TypeError):
            continue
        live.append((agent_dir / f"attempt_{round_}" / str(event["local_rank"]), event))
    if not live:
        click.echo(f"meshrun stacks: no running workers found in {' '.join(map(str, log_dirs))}"
                   " (the agents' events.jsonl name none that is still alive)", err=True)
        return EXIT_NO_JOB
    targets = [
        Target(i, e["worker_pid"], Path(progress_env(d)["MESHRUN_STACK_FILE"]),
               d / "stack-py-spy.txt")
        for i, (d, e) in enumerate(live)
    ]  # fmt: skip
    taken = collect_stacks(targets)
    records = []
    for i, (d, e) in enumerate(live):
        stack = taken[i]
        progress = read_progress(Path(progress_env(d)["MESHRUN_PROGRESS_FILE"]))
        where = classify(stack.main, progress.blocked if progress else None)
        records.append(WorkerFailure(
            local_rank=e["local_rank"], global_rank=e["rank"], pid=e["worker_pid"], exitcode=0,
            timestamp_ms=int(time.time() * 1000), host=e.get("host", ""),
            node_rank=e.get("node_rank", 0), traceback=stack.text, source="stack", stopped=True,
            state=where.state, collective=where.collective, at=where.at,
            stack_path=stack.path, stack_problem=stack.problem,
            calls=summary(read_record(d / RECORD_FILE)),
        ))  # fmt: skip
    _print(f"{len(files)} agent log(s)", records, [], 0)
    return 0


def _running_workers(path: Path) -> list[tuple[int, dict]]:
    """``(round, worker_start event)`` of the workers of the last round an agent's event log
    shows still running (none once the agent exited), each with its agent's host."""
    events = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if not events or events[-1].get("kind") == "agent_exit":
        return []
    starts = [e for e in events if e.get("kind") == "round_start"]
    if not starts:
        return []
    last = starts[-1]
    exited = {e.get("rank") for e in events if e.get("kind") == "worker_exit"
              and e.get("round") == last.get("round")}  # fmt: skip
    return [
        (last["round"], {**e, "node_rank": last.get("node_rank", 0)})
        for e in events
        if e.get("kind") == "worker_start" and e.get("round") == last.get("round")
        and e.get("rank") not in exited
    ]


def _print(title: str, records: list, silent: list[str], timeout: float) -> None:
    from meshrun.agent.errors import culprits, disagreement, format_places, placed

    records = placed(sorted(records, key=lambda f: f.global_rank))
    blamed, why = culprits(records, live=True)
    found = disagreement(records)
    click.echo(f"{title}: {len(records)} rank(s), stacks taken at {time.strftime('%H:%M:%S')}")
    if blamed:
        click.echo(f"likely cause: rank {', '.join(map(str, blamed))} ({why})")
    elif why and (found is None or found.behind):
        click.echo(f"note: {why}")
    if found is not None and (blamed or not found.behind):  # a moving job's offsets are skew
        click.echo(f"collectives: {found.line}")
    for line in format_places(records, blamed):
        click.echo(line)
    for who in silent:
        click.echo(f"  {who}: no answer within {timeout:g} s", err=True)
