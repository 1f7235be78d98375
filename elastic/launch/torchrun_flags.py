"""torchrun's spellings on ``elastic run``: accepted where they mean the same, answered where not.

Owns the translation of a ``run`` command line before it is parsed: ``--nproc_per_node`` and
every other underscore spelling of our flags become ours; torchrun-only flags that are not
needed here are dropped with a one-line note saying why; those whose meaning differs end in a
one-line "did you mean". Nothing after the script (the worker's own arguments) is touched.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Collection, Sequence

from elastic.foundation.errors import ElasticError


class TorchrunFlagError(ElasticError):
    """A torchrun flag that has no equivalent here; the message says what to use instead."""


#: Same meaning, our name.
ALIASES = {"--rdzv-id": "--job-id"}

#: Not needed here, and why (the flag and its value, if any, are dropped).
NOT_NEEDED = {
    "--standalone": (False, "without --etcd, `elastic run` starts its own etcd on 127.0.0.1"),
    "--rdzv-backend": (True, "the rendezvous is always etcd (give it with --etcd URL)"),
    "--rdzv-conf": (True, "the rendezvous' timeouts are flags here (see `elastic run --help`)"),
    "--node-rank": (True, "ranks come from the rendezvous, never from the command line"),
    "--master-addr": (True, "each round picks its own; --advertise-addr says how to reach "
                            "this node"),
    "--master-port": (True, "each round picks a free port of its own"),
    "--monitor-interval": (True, "the launcher wakes at once when a worker exits"),
    "--start-method": (True, "every worker is a fresh interpreter, as with spawn"),
}

#: Different meaning here: what to use instead.
INSTEAD = {
    "--rdzv-endpoint": "the rendezvous is etcd: use --etcd http://HOST:PORT (and --job-id ID "
                       "for --rdzv-id)",
    "--nnodes": "every node's `elastic run` joins by itself; bound the world with "
                "--min-workers/--max-workers (counted in worker processes, not nodes)",
    "--role": "all workers share one role here",
}


def spellings() -> str:
    """The torchrun spellings ``elastic run`` accepts, for its ``--help``."""
    paragraphs = [
        "torchrun's spellings: --nproc_per_node (and the underscore spelling of every flag "
        "above) is accepted; --rdzv-id means --job-id.",
        "Accepted and ignored, as not needed here: " + ", ".join(NOT_NEEDED) + ", --nnodes 1.",
        "Refused, with a line saying what to use instead: " + ", ".join(INSTEAD) + "."]
    return "\n".join(textwrap.fill(p, 78) for p in paragraphs)


def translate(argv: Sequence[str], value_options: Collection[str]) -> list[str]:
    """Rewrites torchrun spellings in the launcher options of ``argv`` (up to the script).

    Args:
        argv: ``elastic run``'s arguments.
        value_options: our flags that take a value (to find where the script starts).

    Returns:
        The arguments with our spellings; notes about dropped flags are printed to stderr.

    Raises:
        TorchrunFlagError: a torchrun flag whose meaning differs here (``--nnodes 2``, ...).
    """
    out: list[str] = []
    i = 0
    takes_value = set(value_options) | {f for f, (v, _) in NOT_NEEDED.items() if v} \
        | set(INSTEAD) | set(ALIASES)
    while i < len(argv):
        token = argv[i]
        if token in ("-m", "--") or not token.startswith("-") or token == "-":
            return out + list(argv[i:])
        name, eq, value = token.partition("=")
        if name.startswith("--"):
            name = name.replace("_", "-")
        name = ALIASES.get(name, name)
        has_value = name in takes_value and not eq
        if has_value and i + 1 < len(argv):
            value = argv[i + 1]
        step = 2 if has_value else 1
        if name in NOT_NEEDED:
            _note(f"elastic run: {name} is not needed here: {NOT_NEEDED[name][1]} (ignored).")
        elif name == "--nnodes" and value == "1":
            _note("elastic run: --nnodes 1 is not needed here: each node's `elastic run` "
                  "joins by itself (ignored).")
        elif name in INSTEAD:
            raise TorchrunFlagError(f"elastic run: {name} is torchrun's; here {INSTEAD[name]}.")
        else:
            out += [f"{name}={value}"] if eq else [name, *argv[i + 1:i + step]]
        i += step
    return out


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
