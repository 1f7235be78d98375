"""The ``elastic`` command: ``run``, ``status``, ``report`` and ``etcd``.

Owns argument parsing and, with ``elastic.foundation.settings``, the only reads of
``os.environ``. Bad input ends in one line that says what to do and a non-zero exit (2 for
usage, 1 otherwise), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from elastic.foundation.errors import ElasticError
from elastic.foundation.settings import EtcdSecurity
from elastic.foundation.timeouts import Timeouts  # the standard library only: keeps `--help` fast
from elastic.launch.etcd_flags import add_security_flags, security_of

USAGE_ERROR = 2
INTERRUPTED = 128 + 2  # SIGINT, as a shell reports it
# The flags of the timeout table (elastic/foundation/timeouts.py), in seconds: field -> flag.
_TIMEOUT_FLAGS = {field: str(Timeouts.flag_name(field)) for field in Timeouts.FLAGS}
_VALUE_OPTIONS = {"--etcd", "--job-id", "-n", "--nproc-per-node", "--spares", "--min-workers",
                  "--max-workers", "--max-restarts", "--checkpoint", "--backend",
                  "--advertise-addr", "--log-dir", "--tee", "--local-ranks-filter", "--preload",
                  "--metrics-port",
                  *_TIMEOUT_FLAGS.values(), *EtcdSecurity.FLAGS.values()}


class UsageError(ElasticError):
    """The command line is wrong; the message says how to fix it."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`).")


def split_run_argv(argv: Sequence[str]) -> tuple[list[str], list[str], str | None]:
    """Splits ``run``'s arguments into launcher options, the worker's arguments, and a module.

    Everything after the script (or after ``-m MODULE``) belongs to the worker.

    Returns:
        (launcher options, [script, *args] or args of the module, module or None).
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m":
            if i + 1 >= len(argv):
                raise UsageError("elastic run: -m needs a module name, e.g. `-m mypkg.train`.")
            return argv[:i], argv[i + 2:], argv[i + 1]
        if token == "--":
            return argv[:i], argv[i + 1:], None
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:], None
        i += 2 if token in _VALUE_OPTIONS else 1
    return argv, [], None


def _check_job_id(job_id: str, command: str) -> str:
    from elastic.cluster.rounds.keys import check_job_id  # noqa: PLC0415 (keeps `--help` fast)
    try:
        return check_job_id(job_id)
    except ValueError as exc:
        raise UsageError(f"{command}: {exc}") from None


def _run_parser() -> _Parser:
    from elastic.launch.torchrun_flags import spellings  # noqa: PLC0415 (stdlib only)
    p = _Parser(prog="elastic run", description="Start this node's workers of an elastic job.",
                usage="elastic run [options] (script.py | -m module) [args...]",
                epilog=spellings(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etcd", help="etcd client URL(s), comma-separated; default: start an "
                   "embedded etcd on 127.0.0.1 for this job")
    p.add_argument("--job-id", help="the job's name in etcd (default: a fresh id)")
    p.add_argument("-n", "--nproc-per-node", type=int, default=1, dest="nproc",
                   help="worker processes on this node (default 1)")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="warm spare workers on this node: started, imported and registered, "
                        "they train only in place of a worker that died (default 0)")
    p.add_argument("--no-warm-start", action="store_false", dest="warm_start",
                   help="start every worker as a new Python process, not forked from a "
                        "template that imported torch and the script's imports once")
    p.add_argument("--preload", default="", metavar="MOD[,MOD...]",
                   help="modules the warm-start template also imports (besides torch and the "
                        "script's top-level imports)")
    p.add_argument("--node-lease", action="store_true",
                   help="this node's workers share the launcher's etcd lease instead of each "
                        "keeping one alive (for jobs of many nodes: one lease renewal per node); "
                        "the launcher removes a worker that dies or stops sending heartbeats")
    p.add_argument("--min-workers", type=int, default=1,
                   help="fewest workers to train with, all nodes together (default 1)")
    p.add_argument("--max-workers", type=int,
                   help="most workers; extra ones wait as spares (default: no limit)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of crashed workers on this node (--plain: of generations; "
                        "default 3)")
    p.add_argument("--checkpoint", default=os.environ.get("ELASTIC_CHECKPOINT") or None,
                   help="fsspec URL for durable commits (ELASTIC_CHECKPOINT); checked at start, "
                        "and must agree with a checkpoint= set in the script")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="the process group's backend: nccl on GPUs, gloo on CPU (default auto: "
                        "nccl when CUDA is available, else gloo)")
    p.add_argument("--advertise-addr", default="127.0.0.1",
                   help="the address other nodes reach this node on (default 127.0.0.1)")
    p.add_argument("--log-dir", help="directory for the workers' event files (for `report`)")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   default=_env_port("ELASTIC_METRICS_PORT"),
                   help="serve this node's Prometheus metrics on --advertise-addr:P "
                        "(ELASTIC_METRICS_PORT; default: none)")
    defaults = Timeouts()
    for field, flag in _TIMEOUT_FLAGS.items():
        default_s = getattr(defaults, field).total_seconds()
        p.add_argument(flag, type=_seconds_argument(default_s), dest=field, metavar="S",
                       help=f"{Timeouts.FLAGS[field]} (default {default_s:g}; "
                            f"{Timeouts.env_name(field)})")
    p.add_argument("--plain", action="store_true", help="torchrun-compatible mode for plain "
                   "DDP scripts: RANK/WORLD_SIZE/MASTER_* per generation, restart on failure")
    add_security_flags(p)
    p.add_argument("--resume-finished", action="store_true", help="a job whose checkpoint is "
                   "already finished may resume it and train nothing (otherwise an error)")
    from elastic.launch.output import add_output_arguments  # noqa: PLC0415 (stdlib only)
    add_output_arguments(p)
    return p


def _env_port(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise UsageError(f"elastic run: {name}={raw!r} must be a TCP port, e.g. 9400.")
    return int(raw)


def _fresh_job_id() -> str:
    return f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def _worker_command(rest: list[str], module: str | None) -> tuple[tuple[str, ...], str]:
    if module is not None:
        return (sys.executable, "-m", module, *rest), f"-m {module}"
    if not rest:
        raise UsageError("elastic run: no script given; usage: "
                         "`elastic run [options] script.py [args...]` or `-m module`.")
    script = rest[0]
    if not Path(script).is_file():
        raise UsageError(f"elastic run: script {script!r} not found; give the path of a "
                         "Python file (or -m module).")
    return (sys.executable, script, *rest[1:]), Path(script).name


def _seconds_argument(example_s: float):  # noqa: ANN202 (an argparse type)
    """An argparse type: a positive, finite number of seconds, as a timedelta."""
    def parse(raw: str) -> timedelta:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"must be a positive number of seconds, e.g. {example_s:g} (got {raw!r})")
        return timedelta(seconds=value)
    return parse


def _timeouts(args: argparse.Namespace) -> Timeouts:
    """The timeout table: defaults, then ELASTIC_* variables, then the flags given.

    Raises:
        ValueError: a variable is malformed, or a value breaks the table's order.
    """
    given = {field: getattr(args, field) for field in _TIMEOUT_FLAGS
             if getattr(args, field) is not None}
    return Timeouts.from_env(**given)


def cmd_run(argv: Sequence[str]) -> int:
    """``elastic run``: see ``elastic run --help``."""
    from elastic.launch.torchrun_flags import TorchrunFlagError, translate  # noqa: PLC0415
    try:
        argv = translate(argv, _VALUE_OPTIONS)
    except TorchrunFlagError as exc:
        raise UsageError(str(exc)) from None
    options, rest, module = split_run_argv(argv)
    args = _run_parser().parse_args(options)
    command, target = _worker_command(rest, module)
    job_id = _check_job_id(args.job_id, "elastic run") if args.job_id else _fresh_job_id()
    from elastic.launch.launch_spec import LaunchSpec  # noqa: PLC0415 (keeps `--help` fast)
    from elastic.launch.output import OutputOptions  # noqa: PLC0415
    from elastic.launch.preload import parse_preload  # noqa: PLC0415
    # the workers' event files go there (a --plain job's tee files only cost themselves)
    log_dir = (str(Path(args.log_dir).resolve()) if args.plain else
               _writable_dir(args.log_dir, "--log-dir")) if args.log_dir else None
    try:
        spec = LaunchSpec(
            command=command, target=target, etcd=args.etcd or "", job_id=job_id,
            nproc=args.nproc, spares=args.spares, node_lease=args.node_lease,
            min_workers=args.min_workers,
            max_workers=args.max_workers, max_restarts=args.max_restarts,
            checkpoint=args.checkpoint, backend=args.backend, advertise_addr=args.advertise_addr,
            log_dir=log_dir, timeouts=_timeouts(args), plain=args.plain,
            env={**os.environ, **({"ELASTIC_RESUME_FINISHED": "1"} if args.resume_finished
                                  else {})},
            output=OutputOptions.from_args(args, log_dir), security=security_of(args),
            metrics_port=args.metrics_port,
            warm_start=args.warm_start, preload=parse_preload(args.preload))
    except ValueError as exc:
        raise UsageError(f"elastic run: {exc}") from None
    if spec.etcd:  # a command line refused touches nothing, leftovers included
        _check_etcd(spec.etcd, spec.security, "elastic run")
    elif spec.security != EtcdSecurity():
        raise UsageError("elastic run: the --etcd-* TLS and authentication settings need "
                         "--etcd https://HOST:PORT (the embedded etcd is plain, on 127.0.0.1).")
    _remove_leftovers()
    from elastic.launch.checkpoint_claim import held_checkpoint  # noqa: PLC0415
    with held_checkpoint(None if spec.plain else spec.checkpoint, spec.job_id, spec.timeouts):
        return _run_job(spec)


def _writable_dir(path: str, flag: str) -> str:
    """``path`` resolved, made if missing and probed with a file written and removed.

    Raises:
        UsageError: it cannot be made or written (checked before any worker starts).
    """
    resolved = Path(path).resolve()
    try:
        resolved.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=resolved, prefix=".elastic-probe-"):
            pass
    except OSError as exc:
        raise UsageError(f"elastic run: {flag} {path} cannot be written ({exc.strerror or exc}); "
                         "give a directory this user can create and write.") from None
    return str(resolved)


def _run_job(spec) -> int:  # noqa: ANN001 (LaunchSpec is imported lazily)
    """Launches this node's part of the job, on ``spec.etcd`` or an embedded etcd."""
    if spec.etcd:
        return _launch(spec, embedded=False)
    from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: PLC0415
    server = EmbeddedEtcd(timeouts=spec.timeouts).start()
    try:
        return _launch(dataclasses.replace(spec, etcd=server.url), embedded=server)
    finally:
        server.stop()
        print(f"elastic: stopped the embedded etcd at {server.url}", file=sys.stderr,
              flush=True)


def _remove_leftovers() -> None:
    """Removes the etcd data and lease-file directories of launchers that were killed."""
    from elastic.launch.launcher_lease_files import LEASES_PREFIX  # noqa: PLC0415
    from elastic.launch.metrics import EVENTS_PREFIX  # noqa: PLC0415
    from elastic.launch.parent_death import OwnedDirs  # noqa: PLC0415
    removed = OwnedDirs.remove_leftovers("elastic-etcd-", LEASES_PREFIX, EVENTS_PREFIX)
    if removed:
        print(f"elastic: removed {len(removed)} directories left by launchers that were killed "
              f"({', '.join(d.name for d in removed)})", file=sys.stderr, flush=True)


def _check_etcd(urls: str, security: EtcdSecurity, command: str) -> None:
    from elastic.cluster.etcd.client import uses_tls  # noqa: PLC0415
    try:
        uses_tls(urls, security)
    except ValueError as exc:
        raise UsageError(f"{command}: {exc}") from None


def _launch(spec, embedded) -> int:  # noqa: ANN001 (imported lazily: EmbeddedEtcd or False)
    from elastic.launch.launch_spec import join_command  # noqa: PLC0415
    from elastic.launch.launcher import Launcher  # noqa: PLC0415
    launcher = Launcher(spec)
    try:
        first = launcher.connect()
        if embedded and embedded.process is not None:
            launcher.watch_etcd(embedded.process, str(embedded.log_path))
        where = "embedded etcd" if embedded else "etcd"
        verb = "started" if first else "joined"
        spares = f" and {spec.spares} warm spare(s)" if spec.spares else ""
        print(f"elastic: {verb} job {spec.job_id} on {where} {spec.etcd} with {spec.nproc} "
              f"worker(s){spares} on this node. To add a worker from another terminal:\n"
              f"    {join_command(spec)}", file=sys.stderr, flush=True)
        code = launcher.run()
    finally:
        launcher.close()
    print(f"elastic: job {spec.job_id} on this node ended with exit status {code}",
          file=sys.stderr, flush=True)
    return code


def cmd_status(argv: Sequence[str]) -> int:
    """``elastic status --etcd URL --job-id ID [--json]``."""
    p = _Parser(prog="elastic status", description="Show a job's members, round and commits.")
    p.add_argument("--etcd", required=True, help="etcd client URL(s)")
    p.add_argument("--job-id", required=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    add_security_flags(p)
    args = p.parse_args(argv)
    _check_job_id(args.job_id, "elastic status")
    from elastic.launch.status import show  # noqa: PLC0415
    try:
        security = security_of(args)
        _check_etcd(args.etcd, security, "elastic status")
        return show(args.etcd, args.job_id, Timeouts.from_env(), as_json=args.json,
                    security=security)
    except ValueError as exc:
        raise UsageError(f"elastic status: {exc}") from None


def cmd_report(argv: Sequence[str]) -> int:
    """``elastic report LOGDIR [--out report.png]``."""
    p = _Parser(prog="elastic report", description="Summarise a job's event files.")
    p.add_argument("log_dir", help="the --log-dir of the run")
    p.add_argument("--out", help="PNG timeline to write (default LOGDIR/report.png)")
    args = p.parse_args(argv)
    if args.out is not None and Path(args.out).suffix.lower() != ".png":
        raise UsageError(f"elastic report: --out {args.out} must name a .png file (the "
                         "timeline is a PNG; the tables go to the console).")
    from elastic.launch.report import report  # noqa: PLC0415
    return report(args.log_dir, args.out)


def cmd_etcd(argv: Sequence[str]) -> int:
    """``elastic etcd [--data-dir DIR]``: a local etcd in the foreground until Ctrl-C."""
    p = _Parser(prog="elastic etcd", description="Run a local etcd on 127.0.0.1.")
    p.add_argument("--data-dir", help="keep etcd's data here (default: a temporary directory)")
    args = p.parse_args(argv)
    try:
        timeouts = Timeouts.from_env()
    except ValueError as exc:
        raise UsageError(f"elastic etcd: {exc}") from None
    from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: PLC0415
    from elastic.launch.stop_signal import StopSignal  # noqa: PLC0415
    stop = StopSignal(threading.Event(), "stopping etcd", shutdown=timeouts.shutdown,
                      again="asked again: stopping etcd")
    restore = stop.install()
    server = EmbeddedEtcd(args.data_dir, timeouts=timeouts).start()
    try:
        print(f"etcd listening on {server.url}  (Ctrl-C stops it)\nStart workers with:\n"
              f"    elastic run --etcd {server.url} --job-id {_fresh_job_id()} -n 2 train.py\n"
              "(one job id per job: every launcher of a job passes the same one)", flush=True)
        wake_s = timeouts.wake.total_seconds()
        while not stop.requested.wait(timeout=wake_s):
            if server.process is None or server.process.poll() is not None:
                raise ElasticError(f"etcd exited unexpectedly; see {server.log_path}.")
        return 0
    finally:
        server.stop()
        restore()


COMMANDS = {"run": cmd_run, "status": cmd_status, "report": cmd_report, "etcd": cmd_etcd}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastic`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    level = os.environ.get("ELASTIC_LOG_LEVEL", "WARNING").upper()
    # Warnings read like the launcher's own lines; asked for more, each line has its time.
    logging.basicConfig(level=level, format="elastic: %(message)s" if level == "WARNING"
                        else "%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv and argv[0] in ("--version", "-V"):
        from elastic.launch.version import describe  # noqa: PLC0415
        print(describe())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: elastic [--version] {run,status,report,etcd} ...\n  run     start this node's "
              "workers\n  status  show a job\n  report  summarise event files\n  etcd    run "
              "a local etcd\nSee `elastic COMMAND --help`.")
        return 0 if argv else USAGE_ERROR
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise UsageError(f"elastic: unknown command {argv[0]!r}; use one of "
                             f"{', '.join(COMMANDS)} (see `elastic --help`).")
        return command(argv[1:])
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return USAGE_ERROR
    except (ElasticError, FileNotFoundError) as exc:
        print(f"elastic: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the launcher's own handler is installed, or in status
        print("elastic: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
