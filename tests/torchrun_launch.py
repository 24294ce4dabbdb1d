"""Start a test program under torchrun on this machine (gloo over loopback) and read the JSON it writes."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from tests.processes import run_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_json(worker: Path, out: Path, nproc: int, *args: object, timeout_s: float = 900) -> dict:
    """Run `worker MODEL... OUT ARGS` with `nproc` ranks; its `OUT/result.json`. `args` come after `out`."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(worker), *map(str, args),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = run_group(command, timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())
