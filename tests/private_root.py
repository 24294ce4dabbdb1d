"""A sandbox's private file tree on this host, and how to run a command inside it.

Shared by the test stand-ins for remote providers (tests/fake_e2b.py, tests/harbor_local_env.py):
`/workspace`, `/tmp` and `/home` are the sandbox's own directories; the rest of the host is
visible read-only. Commands run under bubblewrap without a pid namespace, so background
processes outlive their command exactly as in a real sandbox; every process carries
`E2B_SANDBOX_ID` so that `kill_all` can find it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

PRIVATE_ROOTS = ("workspace", "tmp", "home")
SANDBOX_PATH = f"{os.path.dirname(sys.executable)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The host's tools, this interpreter's environment first: it stands in for an image with Python."""


class PrivateRoot:
    def __init__(self, disk: Path, sandbox_id: str, *, network: bool) -> None:
        self.disk = disk
        self.sandbox_id = sandbox_id
        self.network = network
        for name in PRIVATE_ROOTS:
            (disk / name).mkdir(parents=True, exist_ok=True)
        home = disk / "home" / "user"
        home.mkdir(exist_ok=True)
        # login shells reset PATH from /etc/profile; the sandbox user's profile puts it back
        (home / ".bash_profile").write_text(f"export PATH={SANDBOX_PATH}\n")

    def host_path(self, path: str) -> Path:
        """Where a sandbox path lives on the host (private roots map into `disk`)."""
        path = os.path.normpath("/" + path.lstrip("/")) if path.startswith("/") else f"/home/user/{path}"
        top = path.strip("/").split("/", 1)[0]
        return self.disk / path.lstrip("/") if top in PRIVATE_ROOTS else Path(path)

    def writable(self, host: Path) -> bool:
        return host.parent.resolve().is_relative_to(self.disk.resolve())

    def env(self, *layers: dict[str, str]) -> dict[str, str]:
        env = {"PATH": SANDBOX_PATH, "HOME": "/home/user", "USER": "user", "LANG": "C.UTF-8"}
        for layer in layers:
            env |= layer
        return env | {"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": self.sandbox_id}

    def argv(self, cmd: str, args: list[str], cwd: str) -> list[str]:
        binds: list[str] = []
        for entry in sorted(os.scandir("/"), key=lambda e: e.name):
            if entry.name in ("proc", "dev", "sys", "var", "run", *PRIVATE_ROOTS):
                continue  # /var and /run hold Docker's mounts, which come and go while tests run
            if entry.is_symlink():
                binds += ["--symlink", os.readlink(entry.path), entry.path]
            else:
                binds += ["--ro-bind", entry.path, entry.path]
        for name in PRIVATE_ROOTS:
            binds += ["--bind", str(self.disk / name), f"/{name}"]
        if Path(sys.prefix).parts[1] in (*PRIVATE_ROOTS, "var", "run"):  # the test venv lives in a hidden root
            binds += ["--ro-bind", sys.prefix, sys.prefix]
        net = [] if self.network else ["--unshare-net"]
        scratch = ["--tmpfs", "/var", "--tmpfs", "/run"]
        return [
            "bwrap",
            *net,
            *binds,
            *scratch,
            "--dev",
            "/dev",
            "--ro-bind",
            "/proc",
            "/proc",
            "--chdir",
            cwd,
            cmd,
            *args,
        ]

    def destroy(self) -> None:
        """Kill every process of the sandbox and delete its files."""
        marker = f"E2B_SANDBOX_ID={self.sandbox_id}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
        shutil.rmtree(self.disk, ignore_errors=True)
