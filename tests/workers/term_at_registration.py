"""A worker sent SIGTERM at the instant it has registered with the job, before ``run`` has
trained anything: it must leave (exit 0, "left" printed), not die of the signal."""

import argparse
import signal

import torch

from elastic import ElasticState
from elastic.foundation.events import EventLog

p = argparse.ArgumentParser()
p.add_argument("--out")
p.parse_args()

emit = EventLog.emit


def emit_then_signal(self: EventLog, event: str, **fields: object) -> None:
    emit(self, event, **fields)
    if event == "joined":  # the launcher's SIGTERM lands as the registration is written
        signal.raise_signal(signal.SIGTERM)


EventLog.emit = emit_then_signal  # type: ignore[method-assign]
model = torch.nn.Linear(2, 1)
state = ElasticState(model=model, step=0)
returned = state.run(lambda s: "trained")
print(f"left with {returned!r} at step {state.step}", flush=True)
