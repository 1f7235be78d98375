"""One warm-start template for the workers the tests start: ``elastic run``'s template
(``elastic.launch.template_process``) forking any worker command, not only its own, so that a
test's worker skips the interpreter's start and the imports of torch and the package.

``Job.start`` asks it (``WorkerTemplate.start_worker``), and starts the worker cold when it
cannot. The request names the command in the worker's environment (``COMMAND``, removed before
the worker sees it); the rest, what the worker does not share with the template, is the
product's. The pytest process becomes a child subreaper, as ``elastic run``'s launcher does, so
a forked worker is its child: ``ForkedProcess`` reaps it and gives its exit status.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta

from elastic.launch.template_process import Template, WorkerRun, parse_arguments
from elastic.launch.warm_start import ForkedProcess, WarmStart

#: The worker's command (a JSON list), in the environment of a request.
COMMAND = "TEST_TEMPLATE_COMMAND"


class AnyCommandTemplate(Template):
    """The product's template, running the command each request names."""

    def _fork(self, env: dict[str, str], fds: list[int]) -> bool:
        self.run = WorkerRun(tuple(json.loads(env.pop(COMMAND))))
        return super()._fork(env, fds)


class WorkerTemplate(WarmStart):
    """The tests' side: a template that preloaded ``command``'s imports and forks workers.

    Args:
        command: a worker command whose imports the template preloads.
        env: the template's environment.
    """

    module = "tests.support.worker_template"

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        super().__init__(command, env, (), ready_within=timedelta(seconds=120),
                         answer_within=timedelta(seconds=30))

    def start_worker(self, command: Sequence[str], env: Mapping[str, str],
                     output: int) -> ForkedProcess | None:
        """Forks a worker that runs ``command`` with ``env``, its stdout and stderr into
        descriptor ``output``; None when the template cannot (start it cold)."""
        pid = self.fork({**env, COMMAND: json.dumps(list(command))}, [output, output])
        return None if pid is None else ForkedProcess(pid, None, None)


class LazyTemplate:
    """The session's template, started at its first use (a run of unit tests starts none);
    ``ELASTIC_TEST_COLD_WORKERS=1`` starts every worker cold instead.

    Args:
        command: a worker command whose imports the template preloads.
        env: the template's environment.
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        self.command = list(command)
        self.env = dict(env)
        self.template: WorkerTemplate | None = None
        self.tried = env.get("ELASTIC_TEST_COLD_WORKERS") == "1"

    def __call__(self) -> WorkerTemplate | None:
        """The template while it serves, else None."""
        if not self.tried:
            self.tried = True
            template = WorkerTemplate(self.command, self.env)
            template.start()
            if template.wait_ready():
                self.template = template
        return self.template if self.template is not None and self.template.serving else None

    def close(self) -> None:
        if self.template is not None:
            self.template.close()


def main(argv: list[str]) -> WorkerRun | None:
    control, _, run = parse_arguments(argv)
    return AnyCommandTemplate(control, run).serve(())


if __name__ == "__main__":
    _worker = main(sys.argv[1:])
    if _worker is not None:
        sys.path[0] = _worker.path_entry()
        _worker.run()  # at the top level: the script's exit is the interpreter's
