"""The shape of a committed payload (``TrainState.committed()``): ``{"version": int,
"objects": {name: state}}``, and the check that a payload from elsewhere (a peer, a
checkpoint) has it. Knows nothing of the objects' states; must not import ``elastic`` or
``checkpoint``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic.state.errors import StateKeyError

__all__ = ["payload_parts"]


def payload_parts(payload: Any) -> tuple[int, Mapping[str, Any]]:
    """The version and objects of ``payload``.

    Raises:
        StateKeyError: it is not a mapping of exactly those keys, or the version is not a
            non-negative int, or the objects are not a mapping.
    """
    if not isinstance(payload, Mapping) or set(payload) != {"version", "objects"}:
        keys = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        raise StateKeyError(f"a committed payload has exactly the keys ['objects', "
                            f"'version'], got {keys}.")
    version, objects = payload["version"], payload["objects"]
    if type(version) is not int or version < 0 or not isinstance(objects, Mapping):
        raise StateKeyError(f"a committed payload has a non-negative int version and a "
                            f"mapping of objects, got {type(version).__name__} "
                            f"{version!r:.40} and {type(objects).__name__}.")
    return version, objects
