"""Notices that the embedded etcd of ``elastic run`` exited, and says what that means.

The launcher that started the job's embedded etcd cannot go on without it: this wakes the
launcher at once and words the one line that tells the person what to do.
"""

from __future__ import annotations

import subprocess
import threading

from elastic.launch.worker_procs import describe_exit


class EtcdExit:
    """Notices that the embedded etcd process exited, and wakes the launcher at once.

    Args:
        process: the etcd server process.
        log_path: its log file, named in the message.
        wake: the Event the launcher waits on.
    """

    def __init__(self, process: subprocess.Popen[bytes], log_path: str,
                 wake: threading.Event) -> None:
        self.process = process
        self.log_path = log_path
        self.said = False
        self._exited = threading.Event()
        self._wake = wake
        threading.Thread(target=self._wait, name="elastic-etcd-exit", daemon=True).start()

    def _wait(self) -> None:
        self.process.wait()
        self._exited.set()
        self._wake.set()

    def is_set(self) -> bool:
        return self._exited.is_set()

    def message(self) -> str:
        return (f"the embedded etcd exited ({describe_exit(self.process.returncode or 0)}; its "
                f"log is kept: {self.log_path}); the job cannot go on without it, so its workers are "
                "stopped. Start the job again (it resumes from --checkpoint), or give "
                "`--etcd URL` of an etcd that outlives the job.")
