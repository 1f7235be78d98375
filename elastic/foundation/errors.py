"""Typed errors of the cluster layer.

Expected control flow ends in ``Interrupt``; failures end in ``Error``. Every message says what
to do next.
"""

from __future__ import annotations


class ElasticError(Exception):
    """Base class of every failure raised by the ``elastic`` package."""


class EtcdUnavailableError(ElasticError):
    """etcd could not be reached within the retry deadline."""


class EtcdAccessError(ElasticError):
    """etcd refused this client: a certificate, the credentials, or a permission is wrong, or a
    request is over one of the server's limits.

    Not retried (it would not pass by waiting); the message names the setting to fix.
    """


class FencedError(ElasticError):
    """This member's lease is gone: it must not act under its old identity."""


class CutOffError(ElasticError):
    """The job went on without this member: the network between it and the others went down.
    It must not act under its old identity; it comes back as a new member once it reaches
    them again."""


class RendezvousTimeoutError(ElasticError):
    """A round could not be formed before its deadline (too few workers, or never admitted)."""


class PeerFailureError(ElasticError):
    """A peer died or was cut off: the process group is broken and must be re-formed."""


class AdvertiseAddressError(ElasticError):
    """The advertised address is not an address of this machine, so nothing can listen on it."""


class DeviceUnavailableError(ElasticError):
    """No GPU this worker may use: none visible, ``LOCAL_RANK`` beyond them, or all held."""


class EtcdRecordError(ElasticError):
    """A record in the job's etcd prefix that the job cannot go on without is malformed."""


class FencingContestedError(EtcdRecordError):
    """The job's fencing epoch kept changing under this member's claim: something other than
    the job's members writes that key (a stray process, or another job of the same id)."""


class RendezvousClosedError(ElasticError):
    """The job has completed: no new round will form."""


class NothingTrainedError(ElasticError):
    """The job resumed from a checkpoint and the training function returned without a
    single commit: it was already finished (``--resume-finished`` allows this)."""


class DurableCommitsFailedError(ElasticError):
    """The job asked for durable commits and not one of them was written."""


class SetupError(ElasticError):
    """A mistake in the job's setup (its settings, or the code its workers run), found before
    the worker trained: no restart fixes it."""


class CheckpointUnusableError(SetupError):
    """The checkpoint URL names a location this worker cannot write; the message says why."""


class CheckpointResumeError(ElasticError):
    """A resume (no commit in memory) could not read the checkpoint URL: the job stopped rather
    than start from scratch while that URL may hold its checkpoints."""


class UnfinishedWriteError(ElasticError):
    """The last durable write had not finished when the worker was done (``final_write``)."""


class ElasticInterrupt(Exception):
    """Base class of the expected control-flow signals of the run loop."""


class MembershipChangedInterrupt(ElasticInterrupt):
    """Raised at a commit when the world changes: the state is committed, the group re-forms."""


class LeaveInterrupt(ElasticInterrupt):
    """Raised at a commit on the member that was asked to leave (SIGTERM/SIGINT)."""
