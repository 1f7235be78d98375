"""The ``example`` part of ``gpu_fsdp.py``: ``examples/fsdp_lm.py`` under ``elastic run -n 1``
on the device, read from its output and its checkpoint folder.

Owns the run (bounded: killed with its process group past the timeout), reading the loss
lines, the compute dtype and the durable commits from the output, and finding the newest
durable sharded checkpoint on disk. Imported as ``gpu_fsdp_example``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOSS = re.compile(r"epoch (\d+) step (\d+) world (\d+) loss ([0-9.]+)")
DTYPE = re.compile(r"compute in (\w+)")
DURABLE = re.compile(r"durable checkpoint v(\d+) written")


def _launcher() -> str:
    beside = Path(sys.executable).with_name("elastic")
    found = str(beside) if beside.exists() else shutil.which("elastic")
    if found is None:
        raise FileNotFoundError("no `elastic` script beside this python or on PATH: install "
                                "the project (pip install .) or put its bin/ on PATH.")
    return found


def example(device: str, epochs: int, size: str, text_bytes: int | None, timeout_s: float,
            out: Path) -> dict:
    """Runs the example to its end; its log goes to ``out/example-log.txt``."""
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="gpu-fsdp-example-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        command = [_launcher(), "run", "-n", "1", "--backend", backend,
                   "--checkpoint", f"file://{ckpt}", "--log-dir", str(Path(tmp) / "events"),
                   str(REPO / "examples" / "fsdp_lm.py"), "--size", size,
                   "--epochs", str(epochs)]
        if text_bytes:
            command += ["--text-bytes", str(text_bytes)]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
                   ELASTIC_ADVERTISE_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
        lines, code = _run_logged(command, env, timeout_s, out / "example-log.txt")
        result = _read_example_log(lines)
        result.update(command=command[1:], exit_code=code, exited_0=code == 0,
                      **_durable_found(ckpt))
    expected = "bfloat16" if device == "cuda" else "float32"
    result["compute_dtype_as_expected"] = result.get("compute_dtype") == expected
    return result


def _run_logged(command: list[str], env: dict, timeout_s: float, log: Path
                ) -> tuple[list[tuple[float, str]], int | None]:
    """Runs ``command``; every output line with the monotonic time it was read, and the exit
    status (None when it ran past ``timeout_s``: then its process group is killed). The output
    is read on a thread, so a run that hangs silently is still stopped in time."""
    lines: list[tuple[float, str]] = []
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.monotonic(), line.rstrip("\n")))
                sink.write(line)

        reader = threading.Thread(target=read, name="example-output", daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _stop(proc)
        reader.join(30)
    return lines, code


def _stop(proc: subprocess.Popen) -> None:
    """Ends the launcher and everything it started (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_example_log(lines: list[tuple[float, str]]) -> dict:
    losses = [(t, int(m[2]), float(m[4])) for t, text in lines if (m := LOSS.search(text))]
    dtypes = [m[1] for _, text in lines if (m := DTYPE.search(text))]
    durable = [int(m[1]) for _, text in lines if (m := DURABLE.search(text))]
    result: dict = {"loss_lines": len(losses), "compute_dtype": dtypes[0] if dtypes else None,
                    "durable_versions_logged": durable}
    if len(losses) >= 2:
        measured = losses[len(losses) // 4:]
        (t0, s0, _), (t1, s1, _) = measured[0], measured[-1]
        result.update(loss_first=losses[0][2], loss_last=losses[-1][2], steps=losses[-1][1],
                      steps_per_s=(s1 - s0) / (t1 - t0) if t1 > t0 else None,
                      loss_went_down=losses[-1][2] < losses[0][2])
    else:
        result["loss_went_down"] = False
    return result


def _durable_found(ckpt: Path) -> dict:
    """The newest durable sharded checkpoint under ``ckpt``: a version folder with our manifest,
    DCP's ``.metadata`` (read with DCP's own reader: the model's and optimizer's entries) and at
    least one shard file."""
    whole = [d for d in sorted(ckpt.glob("*")) if (d / "manifest.json").exists()
             and (d / ".metadata").exists() and list(d.glob("*.distcp"))]
    if not whole:
        return {"durable_checkpoint_written": False}
    newest = whole[-1]
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415  (torch: slow)

    entries = FileSystemReader(str(newest)).read_metadata().state_dict_metadata
    return {"durable_checkpoint_written": True, "durable_checkpoints": len(whole),
            "durable_dcp_entries": len(entries),
            "durable_dcp_has_model_and_optimizer": any(k.startswith("model") for k in entries)
            and any(k.startswith("optim") for k in entries),
            "durable_newest": newest.name,
            "durable_newest_files": sorted(p.name for p in newest.iterdir()),
            "durable_newest_mib": sum(p.stat().st_size for p in newest.iterdir()) / 2**20}
