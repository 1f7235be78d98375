"""How the package's errors reach the user's code: the message alone, the causes kept aside.

Owns the boundary where an ``ElasticError`` leaves ``ElasticState.run``. Its message already
names the cause and the fix (a wrong etcd password, an etcd that does not answer), so the chain
of third-party errors behind it (a gRPC error, the etcd client's own) would only bury that line
under tracebacks. The chain is written to the event log (an ``error`` event with ``causes``) and
to the debug log, and dropped from what Python prints, unless ``ELASTIC_DEBUG=1``.
"""

from __future__ import annotations

import logging
import traceback

from elastic.foundation.errors import ElasticError
from elastic.foundation.events import EventLog

log = logging.getLogger(__name__)


def has_causes(exc: BaseException) -> bool:
    """Whether Python would print an error before ``exc`` (its cause or its context)."""
    return exc.__cause__ is not None or (exc.__context__ is not None
                                         and not exc.__suppress_context__)


def drop_causes(exc: ElasticError, events: EventLog, debug: bool,
                keep_frames: bool = True) -> ElasticError:
    """Records ``exc``'s chain of causes, then, unless ``debug``, detaches it (as ``raise ...
    from None`` would), so that the traceback ends in the one line that says what to do.

    Args:
        exc: the error on its way to the user's code.
        events: where the causes are recorded.
        debug: ``ELASTIC_DEBUG=1``: keep everything.
        keep_frames: False when every frame of its traceback is the package's (it was raised
            before the user's function was called): they are dropped too.

    Returns:
        ``exc``, to be raised.
    """
    if has_causes(exc):
        causes = "".join(traceback.format_exception(exc))
        events.emit("error", error=type(exc).__name__, message=str(exc), causes=causes)
        log.debug("%s, caused by:\n%s", type(exc).__name__, causes)
    if debug:
        return exc
    exc.__cause__ = None
    exc.__suppress_context__ = True
    return exc if keep_frames else exc.with_traceback(None)
