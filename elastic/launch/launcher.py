"""The per-node launcher of ``elastic run``: starts ``-n`` workers and looks after them.

Elastic mode (the default, for ElasticState workers): every worker is one member of the job. A
worker that dies abnormally has its etcd lease revoked at once (so that the survivors do not
wait for the lease TTL) and is restarted, up to ``max_restarts``, as a new member; a worker that
exits 0 is done. Plain mode (``--plain``) is in ``elastic.launch.plain``. SIGINT/SIGTERM make every
local worker leave at its next commit; stragglers are killed after a grace period. The launcher
registers itself under the job's launcher keys, so that ``elastic status`` and later launchers
see it. It reads no environment variables: ``elastic.launch.cli`` hands it everything.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

from elastic.foundation.errors import EtcdUnavailableError
from elastic.cluster.etcd.client import EtcdClient
from elastic.launch.etcd_exit import EtcdExit
from elastic.launch.job_config import claim
from elastic.launch.launcher_lease_files import LeaseFiles
from elastic.launch.metrics import NodeMetrics
from elastic.launch.node_members import NodeMembers
from elastic.launch.joined import JoinedWorkers
from elastic.launch.launch_spec import LaunchSpec
from elastic.launch.output import WorkerOutput
from elastic.launch.replacements import Replacement, Replacements
from elastic.launch.restarts import Restarts, import_failure
from elastic.cluster.worker_lease_file import RAN, SETUP_ERROR
from elastic.launch.stop_signal import StopSignal
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.launch.warm_start import WarmStart, reap_adopted
from elastic.launch.worker_procs import Worker, WorkerProcs
from elastic.launch.death_lines import died, named, with_detail

log = logging.getLogger(__name__)


def revoke_worker_leases(client: EtcdClient, leases: list[int]) -> list[int]:
    """Revokes the leases a worker of this launcher reported (``LeaseFiles``): never a lease
    found by matching host name and pid in etcd, which another container can share.

    Returns:
        The leases that were still alive and are revoked now.
    """
    return [lease for lease in leases if client.revoke(lease)]


class Launcher:
    """Runs one node's share of a job.

    Args:
        spec: what to launch.
    """

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.keys = JobKeys(spec.job_id)
        self.procs = WorkerProcs(spec.command, spec.env, spec.timeouts.reap,
                                 spec.timeouts.drain, WorkerOutput(spec.output, socket.gethostname()))
        self.stop = StopSignal(self.procs.changed, shutdown=spec.timeouts.shutdown)
        self.client: EtcdClient | None = None
        self.membership: EtcdMembership | None = None
        self.leases = LeaseFiles()
        self.joined: JoinedWorkers | None = None
        self.replacements: Replacements | None = None
        self.etcd_exit: EtcdExit | None = None
        self.node_members: NodeMembers | None = None  # with --node-lease
        self._spares: set[int] = set()  # pids of warm spares that have not taken a place
        self.metrics: NodeMetrics | None = None  # with --metrics-port

    def connect(self) -> bool:
        """Connects to etcd, claims or checks the job's configuration and registers.

        Returns:
            True when this launcher started the job.

        Raises:
            EtcdUnavailableError: etcd did not answer within the connect timeout.
            JobConfigError: the job runs with another configuration.
        """
        self.client = EtcdClient(self.spec.etcd, timeouts=self.spec.timeouts,
                                 retry_for=self.spec.timeouts.connect,
                                 security=self.spec.security)
        first = claim(self.client, self.keys, self.spec.job_config())
        self.membership = EtcdMembership(self.client, self.keys.launchers(),
                                         self.spec.advertise_addr, self.spec.timeouts)
        self.membership.register()
        if self.spec.node_lease:
            membership = self.membership
            self.node_members = NodeMembers(self.client, self.keys, self.leases,
                                            lambda: membership.lease, self.spec.timeouts.lease_ttl)
        if not self.spec.plain:
            self.joined = JoinedWorkers(self.client, self.keys)
            self.joined.start()
            self.replacements = Replacements(self.client, self.keys, self.procs.changed,
                                             self.spec.timeouts.replace_wait,
                                             self.spec.timeouts.settle)
            self.replacements.start()
        return first

    def run(self) -> int:
        """Starts the workers and looks after them until they are all done.

        Returns:
            The job's exit status on this node: 0 when every worker finished or left cleanly.
        """
        assert self.client is not None and self.membership is not None, "connect() first"
        restore = self.stop.install()
        self._serve_metrics()
        if self.spec.caps_threads:
            _say(f"OMP_NUM_THREADS=1 for each of the {self.spec.nproc + self.spec.spares} "
                 "workers (set OMP_NUM_THREADS to choose another thread count)")
        try:
            if self.spec.plain:
                from elastic.launch.plain import PlainGenerations  # noqa: PLC0415 (torch import)
                return PlainGenerations(self).run()
            code = self._run_elastic()
            self._serve_others()
            return code
        finally:
            restore()
            self.procs.kill()
            if self.procs.warm is not None:
                self.procs.warm.close()
            if self.metrics is not None:
                self.metrics.stop()

    def _serve_metrics(self) -> None:
        """Serves Prometheus metrics on ``--metrics-port``; a port that cannot be served is
        one line, and the job runs without them."""
        if self.spec.metrics_port is None or self.spec.plain:
            return
        running = lambda: {w.pid for w in self.procs.running()}  # noqa: E731
        self.metrics = NodeMetrics(self.spec.metrics_port, self.spec.advertise_addr,
                                   self.spec.log_dir, lambda: len(self._spares & running()),
                                   self.spec.timeouts.shutdown)
        try:
            self.metrics.start()
        except OSError as exc:
            _say(f"cannot serve metrics on {self.spec.advertise_addr}:{self.spec.metrics_port} "
                 f"({exc}); the job runs without them. Choose a free --metrics-port.")
            self.metrics.stop()
            self.metrics = None
            return
        _say(f"Prometheus metrics at http://{self.spec.advertise_addr}:"
             f"{self.spec.metrics_port}/metrics")

    def watch_etcd(self, process: subprocess.Popen[bytes], log_path: str) -> None:
        """Ends the run, in one line, if the embedded etcd ``process`` exits before the job."""
        self.etcd_exit = EtcdExit(process, log_path, self.procs.changed)

    def is_etcd_lost(self) -> bool:
        """Whether the embedded etcd exited; says so once (nothing can go on without it)."""
        if self.etcd_exit is None or not self.etcd_exit.is_set():
            return False
        if not self.etcd_exit.said:
            self.etcd_exit.said = True
            _say(self.etcd_exit.message())
        return True

    def _serve_others(self) -> None:
        """Keeps the embedded etcd this launcher holds serving while other launchers are in the
        job (their workers train on without this node's), saying so in one line; a second
        Ctrl-C, or their leaving, ends the wait."""
        if self.etcd_exit is None or self.stop.forced.is_set() or self.is_etcd_lost():
            return
        others = self._other_launchers()
        if not others:
            return
        _say(f"this launcher holds the job's embedded etcd: it keeps serving the {others} other "
             "launcher(s) until they leave (Ctrl-C again ends it now, and their job with it)")
        self.stop.again = "asked again: ending the embedded etcd now"
        wake_s = self.spec.timeouts.wake.total_seconds()
        while not self.stop.forced.is_set() and not self.is_etcd_lost():
            if not self._other_launchers():
                _say("the other launchers left; ending the embedded etcd")
                return
            self.procs.changed.wait(wake_s)
            self.procs.changed.clear()

    def _other_launchers(self) -> int:
        """How many other launchers are registered in the job (0 when etcd cannot say)."""
        assert self.client is not None and self.membership is not None
        launchers = self.keys.launchers()
        try:
            kvs, _ = self.client.get_prefix(launchers.members)
        except EtcdUnavailableError:
            return 0
        return sum(kv.key != launchers.member(self.membership.member_id) for kv in kvs)

    def close(self) -> None:
        """Leaves the launcher membership and closes the etcd client."""
        if self.joined is not None:
            self.joined.stop()
        if self.replacements is not None:
            self.replacements.stop()
        if self.etcd_exit is not None and self.etcd_exit.is_set():
            self.membership = None  # nothing to leave: the keys went with the server
        if self.membership is not None:
            self.membership.leave()
        if self.client is not None:
            self.client.close()
        self.leases.close()

    def _warm_up(self) -> None:
        """Starts the warm-start template and waits for its imports (``--no-warm-start``:
        nothing); the workers are forked from it when it is ready, else start cold."""
        if not self.spec.warm_start:
            return
        timeouts = self.spec.timeouts
        warm = WarmStart(self.spec.command, {**self.spec.env, **self.spec.worker_env(0)},
                         self.spec.preload, timeouts.template_ready, timeouts.fork)
        warm.start()
        if warm.serving and warm.wait_ready():
            self.procs.warm = warm
            if self.replacements is not None:
                self.replacements.hold_after_forming(timeouts.warm_connect)

    def _run_elastic(self) -> int:
        self._warm_up()
        for local_rank in range(self.spec.nproc + self.spec.spares):
            self._start(local_rank, standby=local_rank >= self.spec.nproc)
        restarts = Restarts(self.spec.max_restarts)
        held = self.replacements
        assert held is not None, "connect() first"
        wake_s = self.spec.timeouts.wake.total_seconds()
        if self.node_members is not None:  # heartbeats: checked once per keepalive interval
            wake_s = min(wake_s, self.spec.timeouts.keepalive.total_seconds())
        while True:
            self.procs.changed.wait(timeout=held.wait_s(wake_s))
            self.procs.changed.clear()
            if self.spec.warm_start:  # this launcher adopts its workers' orphans
                reap_adopted()
            if self.node_members is not None:
                self._drop_silent()
            if self.stop.requested.is_set():
                return self._shutdown(restarts.failed)
            if self.is_etcd_lost():
                return 1  # the workers are killed on the way out: none can leave gracefully
            for replacement, why in held.due():
                self._tell(f"starting the replacement of worker local_rank="
                           f"{replacement.local_rank} ({why})")
                self._start(replacement.local_rank, replacement.standby)
            for worker in self.procs.exited():
                code = worker.returncode or 0
                if code == 0:
                    if self.node_members is not None:
                        self.node_members.forget_finished(worker.pid)
                    if not self.leases.has_mark(worker.pid, RAN):
                        _say(restarts.never_joined(worker.local_rank, worker.pid))
                    continue
                if self.metrics is not None:
                    self.metrics.failed(code)
                setup_error = self.leases.has_mark(worker.pid, SETUP_ERROR)
                error_line = worker.last_error_line()
                self._revoke(worker, code, hint=not setup_error
                             and import_failure(error_line) is None)
                committed = self.leases.has_committed(worker.pid)
                self.leases.forget(worker.pid)
                joined = self._has_joined(worker.pid)
                finished = self.joined is not None and self.joined.has_finished(worker.pid)
                refusal = restarts.refusal(worker.local_rank, error_line, joined, finished,
                                           committed, setup_error)
                if refusal:
                    _say(refusal)
                    continue
                self._replace(worker.local_rank, worker.pid, restarts)
            if not self.procs.running() and not held.holding:
                return 1 if restarts.failed else 0

    def _replace(self, local_rank: int, pid: int, restarts: Restarts) -> None:
        """Starts the replacement of crashed worker ``pid``: once the survivors re-formed
        without it (``Replacements``), or at once."""
        assert self.replacements is not None
        replacement = Replacement(local_rank, standby=self.spec.spares > 0)
        members = self.joined.members_of(pid) if self.joined is not None else []
        held = self.replacements.hold(replacement, members)
        when = (f" once the others re-formed without it (at most "
                f"{self.spec.timeouts.replace_wait.total_seconds():g} s)" if held else "")
        if self._take_waiting_spare(pid):
            self._tell(f"a warm spare takes the place of worker local_rank={local_rank}; "
                       f"starting a new spare in its slot{when} (restart {restarts.used} of "
                       f"{self.spec.max_restarts})")
        else:
            self._tell(f"restarting worker local_rank={local_rank}{when} (restart "
                       f"{restarts.used} of {self.spec.max_restarts})")
        if not held:
            self._start(replacement.local_rank, replacement.standby)

    def _take_waiting_spare(self, dead: int) -> bool:
        """Whether a warm spare of this node was waiting (running and joined) to take the place
        of worker ``dead``; that spare counts as placed from now on. A spare's own death takes
        no spare's place. Otherwise the replacement fills the place when it is ready."""
        if dead in self._spares:
            self._spares.discard(dead)
            return False
        running = {w.pid for w in self.procs.running()}
        waiting = sorted(p for p in self._spares if p in running and self._has_joined(p))
        if not waiting:
            return False
        self._spares.discard(waiting[0])
        return True

    def _start(self, local_rank: int, standby: bool = False) -> None:
        """Starts one worker (``standby``: a warm spare), with a file of its own to report its
        leases in."""
        path = self.leases.new_path(local_rank)
        env = {**self.spec.worker_env(local_rank, standby), "ELASTIC_LEASE_FILE": path}
        if self.membership is not None:  # its first round waits for the launcher's workers
            env["ELASTIC_LAUNCHER"] = self.membership.member_id
        env["ELASTIC_LAUNCHER_PID"] = str(os.getpid())  # checked as it joins
        if self.metrics is not None:
            env.update(self.metrics.worker_env())
        if self.node_members is not None:
            assert self.membership is not None, "connect() first"
            env["ELASTIC_NODE_LEASE"] = str(self.membership.lease)
        worker = self.procs.start(local_rank, env)
        if self.metrics is not None:
            self.metrics.pids.add(worker.pid)
        self.leases.assign(worker.pid, path)
        if standby:
            self._spares.add(worker.pid)

    def _has_joined(self, pid: int) -> bool:
        """Whether worker ``pid`` ever registered as a member of the job."""
        return self.joined is not None and self.joined.has_joined(pid)

    def _revoke(self, worker: Worker, code: int, hint: bool = True) -> None:
        """Revokes dead ``worker``'s leases (or removes it from the job) and says it died, in
        one line; what was done in etcd goes to the log (``death_lines``)."""
        assert self.client is not None
        pid, leases = worker.pid, self.leases.read(worker.pid)
        line = died(worker.local_rank, socket.gethostname(), pid, code)
        try:
            revoked = revoke_worker_leases(self.client, leases)
            dropped = self.node_members.drop(pid) if self.node_members is not None else []
        except EtcdUnavailableError as exc:
            _say(f"{line}; could not revoke its lease ({exc})")
            return
        if revoked:
            self._tell(with_detail(line, f"revoked its lease {revoked[-1]:x}"))
        elif dropped:
            self._tell(with_detail(line, f"removed it from the job (member {dropped[-1]})"))
        elif self._has_joined(pid) and code > 0:
            self._tell(f"{line} after it had joined the job and left it (its own error; see "
                       "its output above)")
        elif leases or self._has_joined(pid):
            self._tell(with_detail(line, "its lease was gone already"))
        elif hint:  # (no hint: the refusal to restart it says what went wrong)
            _say(f"{line} before it joined the job. If it is a plain torch.distributed script "
                 "(no ElasticState), run it with `elastic run --plain`.")

    def _tell(self, message: str) -> None:
        """Says one line of the job's story (a death, a restart); ``--quiet`` hides it."""
        if not self.spec.output.quiet:
            _say(message)

    def _drop_silent(self) -> None:
        """Removes the workers under this launcher's lease whose heartbeats stopped."""
        assert self.node_members is not None
        running = {w.pid: w.local_rank for w in self.procs.running()}
        for pid, silent_s, dropped in self.node_members.drop_silent(running):
            if dropped:
                self._tell(f"{named(running[pid], socket.gethostname(), pid)} sent no heartbeat "
                           f"for {silent_s:.1f} s (stopped or hung); removed it from the job "
                           f"(member {dropped[-1]}), as its lease would have expired")

    def _shutdown(self, failed: int) -> int:
        grace = timedelta() if self.stop.forced.is_set() else self.spec.timeouts.grace
        self.procs.terminate(grace, cut=self.stop.forced)
        for worker in self.procs.exited():
            if worker.returncode == -signal.SIGTERM and not self._has_joined(worker.pid):
                _say(f"{named(worker.local_rank, socket.gethostname(), worker.pid)} was "
                     "stopped before it joined the job")
            elif worker.returncode:
                failed += 1
        return self.stop.exit_status or (1 if failed else 0)


def _say(message: str) -> None:
    print(f"elastic: {message}", file=sys.stderr, flush=True)
