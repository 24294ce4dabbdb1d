"""A real Ray cluster of several nodes on this machine, inside a network namespace of its own.

Each node is `ray start --block` with its own loopback address (`--node-ip-address 127.0.0.2`,
`127.0.0.3`, ...: Ray rewrites 127.0.0.1 to the machine's interface address) and a custom
resource naming it (`node1`, `node2`). Ray 2.60 binds its gRPC servers (GCS, raylet, core
workers) to the wildcard address for any node address other than 127.0.0.1, so the nodes, and
`patchgym run` with them, run in a network namespace whose only interface is loopback
(`LoopbackNamespace`): whatever binds the wildcard there listens on loopback, and no packet can
reach any other address. `listening()` lists every listening socket of the namespace, so a test
can assert that.

Stopping: every process in the namespace is SIGKILLed (found by its network namespace, whoever
its parent is: Ray workers run in sessions of their own and outlive a killed raylet), so a test
leaves nothing behind even when it fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.test_launch import descendants

CLONE_NEWNET = 0x40000000
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # 2.60 would write a token to ~/.ray otherwise
    # a busy 2-core machine: the raylet's default wait for its dashboard agent (15 s) is too short
    "RAY_agent_register_timeout_ms": "300000",
}
"""The environment of every node and of the drivers that join them."""

# Brings the namespace's loopback interface up (SIOCGIFFLAGS / SIOCSIFFLAGS, IFF_UP), says so,
# and holds the namespace open until its stdin closes.
_HOLDER = """
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
print("ready", flush=True)
sys.stdin.read()
"""


def _ns_id(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


class LoopbackNamespace:
    """A network namespace with only the loopback interface, held open by a sleeping process."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "--net", sys.executable, "-c", _HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = self.holder.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "ready":
            self.holder.kill()
            raise RuntimeError(f"could not make a network namespace (unshare --net, needs root): {line!r}")
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self.id = _ns_id(self.holder.pid)

    def _enter(self) -> None:
        """preexec_fn: move the child into the namespace before it runs anything."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(self.path, os.O_RDONLY)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            os._exit(121)
        os.close(fd)

    def popen(self, command: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start `command` inside the namespace, in a session of its own, output to `log`."""
        with log.open("a") as out:
            return subprocess.Popen(
                list(command),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                start_new_session=True,
                preexec_fn=self._enter,
            )

    def run(self, command: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None) -> str:
        """Run `command` inside the namespace to its end; its stdout (stderr on failure in the error)."""
        process = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=self._enter,
        )
        try:
            out, err = process.communicate(timeout=timeout_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if process.returncode != 0:
            raise RuntimeError(f"{command[:3]} exited {process.returncode}:\n{err[-3000:]}")
        return out

    def members(self) -> list[int]:
        """Every process in the namespace (the holder too)."""
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ns_id(p.name) == self.id]

    def interfaces(self) -> list[str]:
        """The namespace's network interfaces (from its /proc/net/dev)."""
        lines = Path(f"/proc/{self.holder.pid}/net/dev").read_text().splitlines()[2:]
        return [line.split(":")[0].strip() for line in lines]

    def listening(self) -> list[str]:
        """The local address of every listening TCP socket in the namespace ("127.0.0.2:port", "[::]:port")."""
        found = []
        for name, width in (("tcp", 8), ("tcp6", 32)):
            for line in Path(f"/proc/{self.holder.pid}/net/{name}").read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state != "0A":  # LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)
                # /proc shows each 32-bit word in host (little-endian) order
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))
                address = ipaddress.ip_address(packed)
                host = str(address) if address.version == 4 else f"[{address}]"
                found.append(f"{host}:{int(hex_port, 16)}")
        return found

    def kill_all(self, bound_s: float = 60.0) -> list[int]:
        """SIGKILL every process in the namespace until none is left; returns those it killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + bound_s
        while (left := [p for p in self.members() if p != self.holder.pid]) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.2)
        return sorted(killed)

    def close(self) -> None:
        self.kill_all()
        with contextlib.suppress(OSError):
            self.holder.stdin.close()  # type: ignore[union-attr]
        self.holder.kill()
        self.holder.wait()


def loopback_or_wildcard(address: str) -> bool:
    """Whether a listening address ("host:port") is loopback, or the wildcard (which, in a namespace
    whose only interface is loopback, is loopback too)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    ip = ipaddress.ip_address(host)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def in_loopback(address: str) -> bool:
    """Whether `address` ("127.0.0.3", "127.0.0.3:80", "http://127.0.0.3:80") lies in 127.0.0.0/8."""
    host = address.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0] if ":" in address else address
    return ipaddress.ip_address(host.strip("[]")) in ipaddress.ip_network("127.0.0.0/8")


@dataclass
class RayNode:
    name: str
    address: str
    resources: dict[str, float]
    process: subprocess.Popen | None = None


@dataclass
class LoopbackRayCluster:
    """A head and more raylets on loopback addresses in one `LoopbackNamespace`; see the module docstring."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the nodes (and so their workers), e.g. PYTHONPATH."""
    num_cpus: int = 4
    object_store_bytes: int = 100 << 20
    port: int = 6380
    ns: LoopbackNamespace = field(init=False)
    nodes: dict[str, RayNode] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # Ray's session directories hold unix sockets, whose paths must stay under 108 bytes
        self.ray_root = Path(tempfile.mkdtemp(prefix="pgray-", dir="/tmp"))
        self.ns = LoopbackNamespace()

    @property
    def address(self) -> str:
        """The head's GCS address (`cluster.address` of a run)."""
        head = next(iter(self.nodes.values()))
        return f"{head.address}:{self.port}"

    def environ(self, extra: Mapping[str, str] = {}) -> dict[str, str]:
        return {**os.environ, **RAY_ENV, **self.env, **extra}

    def start_node(self, name: str, address: str, resources: Mapping[str, float]) -> RayNode:
        """`ray start --block` for a node (the first one started is the head)."""
        ray = str(Path(sys.executable).with_name("ray"))
        head = not self.nodes
        command = [ray, "start", "--block", "--node-ip-address", address, "--resources", json.dumps(resources)]
        command += ["--num-cpus", str(self.num_cpus), "--object-store-memory", str(self.object_store_bytes)]
        command += ["--disable-usage-stats", "--temp-dir", str(self.ray_root / name)]
        if head:
            command += ["--head", "--port", str(self.port), "--include-dashboard=false"]
        else:
            command += ["--address", self.address]
        node = self.nodes.get(name) or RayNode(name, address, dict(resources))
        self.nodes[name] = node
        node.process = self.ns.popen(command, log=self.root / f"{name}.log", env=self.environ())
        return node

    def wait_nodes(self, alive: int, timeout_s: float = 600.0, attempt_s: float = 60.0) -> list[dict[str, Any]]:
        """Wait until the cluster reports `alive` live nodes; `ray.nodes()` then. A node whose
        `ray start` exited fails this at once, with its output."""
        probe = (
            "import json, time, ray\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n"
            f"deadline = time.monotonic() + {attempt_s}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) != {alive} and time.monotonic() < deadline:\n"
            "    time.sleep(1)\n"
            "print('NODES ' + json.dumps(ray.nodes()))\n"
        )
        deadline = time.monotonic() + timeout_s
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            self._check_nodes()
            try:  # the head's GCS may not answer yet
                out = self.ns.run([sys.executable, "-c", probe], timeout_s=attempt_s * 2, env=self.environ())
            except (RuntimeError, subprocess.TimeoutExpired):
                time.sleep(2)
                continue
            # Ray may print its own lines (a raylet's "marked dead" notice) beside the answer
            (answer,) = [line for line in out.splitlines() if line.startswith("NODES ")]
            nodes = json.loads(answer.removeprefix("NODES "))
            if sum(n["Alive"] for n in nodes) == alive:
                return nodes
        raise AssertionError(f"expected {alive} live Ray nodes within {timeout_s:.0f} s: {nodes}")

    def _check_nodes(self) -> None:
        for node in self.nodes.values():
            if node.process is not None and node.process.poll() is not None:
                log = (self.root / f"{node.name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"ray start for {node.name} exited ({node.process.returncode}):\n{log}")

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL a node's processes (its `ray start`, raylet, agents, workers and what they started)."""
        node = self.nodes[name]
        assert node.process is not None
        victims = {node.process.pid} | descendants(node.process.pid)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.process.wait()
        node.process = None
        return sorted(victims)

    def popen(self, command: Sequence[str], *, log: Path, env: Mapping[str, str] = {}) -> subprocess.Popen:
        """A driver (e.g. `patchgym run`) inside the cluster's namespace."""
        return self.ns.popen(command, log=log, env=self.environ(env))

    def close(self) -> list[int]:
        """Kill every process of the cluster and of the drivers started in it; the pids it killed."""
        killed = self.ns.kill_all()
        for node in self.nodes.values():
            if node.process is not None:
                node.process.wait()
        self.ns.close()
        shutil.rmtree(self.ray_root, ignore_errors=True)
        return killed


def wait_until(check: Callable[[], bool], bound_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {bound_s:.0f} s")
        time.sleep(poll_s)
