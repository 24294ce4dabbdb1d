# ruff: noqa: UP031 - this file runs inside sandboxes on whatever Python 3 the image has
"""The in-sandbox end of the exec channel: one process that forks each command it is sent.

Started once per sandbox (`python3 -c <this file>`) on a long-lived exec stream, it reads
frames from stdin and writes frames to stdout, so running a command costs a fork and an exec
instead of a new `docker exec`. Standard library only, and written for any Python 3.5+.

Frame: a 9-byte header (`>IBI`: body length, kind, command id) and the body.
- client to server: `R` run (body: JSON with cmd, cwd, env, timeout_s, grace_s, limit),
  `K` kill a command's process group, `H` hello (the server answers `H` with its pid).
- server to client: `H` hello (JSON), `E` end of a command (body: `>I` JSON length, the JSON
  with exit code, timed_out and each stream's head, tail and omitted byte counts, then the
  head and tail bytes of stdout and stderr).
Each command runs as `bash -c cmd` in a process group of its own (a new session), with the
server's environment plus the call's. On timeout its group gets SIGTERM, then SIGKILL after
the grace period; when the command ends, what is left of its group is killed. Each stream
keeps its first `limit // 2` bytes and its last `limit - limit // 2` bytes, so memory stays
bounded however much a command prints. The process groups of running commands are listed
in GROUPS_DIR, so a server started after one that died can kill what it left behind.
"""

import contextlib
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time

HEADER = struct.Struct(">IBI")
GROUPS_DIR = "/tmp/.patchgym-exec/groups"


class Capture:
    """The head and the tail of one output stream, within `limit` bytes."""

    def __init__(self, limit):
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, chunk):
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit:
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_limit:  # trim in batches: amortised O(bytes)
                del self.tail[: len(self.tail) - self.tail_limit]

    def parts(self):
        tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        return bytes(self.head), tail, self.total - len(self.head) - len(tail)


def end_body(exit_code, timed_out, parts):
    """The body of an `E` frame: metadata, then each stream's head and tail bytes."""
    meta = {
        "exit_code": exit_code,
        "timed_out": timed_out,
        "streams": [[len(head), len(tail), omitted] for head, tail, omitted in parts],
    }
    blob = json.dumps(meta).encode()
    return struct.pack(">I", len(blob)) + blob + b"".join(head + tail for head, tail, _ in parts)


class Command:
    """One running command: its process, its output so far and its timers."""

    def __init__(self, cid, request):
        self.cid = cid
        self.timed_out = False
        self.exit_code = None
        self.exited_at = None
        self.grace_s = float(request["grace_s"])
        self.drain_s = float(request["drain_s"])
        self.deadline = time.monotonic() + float(request["timeout_s"])
        self.kill_at = None
        env = dict(os.environ)
        env.update(request["env"])
        self.proc = subprocess.Popen(
            ["bash", "-c", request["cmd"]],
            cwd=request["cwd"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.streams = [Capture(int(request["limit"])), Capture(int(request["limit"]))]
        self.open = {self.proc.stdout.fileno(): self.streams[0], self.proc.stderr.fileno(): self.streams[1]}
        for fd in self.open:
            os.set_blocking(fd, False)
        self.marker = os.path.join(GROUPS_DIR, str(self.proc.pid))
        try:
            open(self.marker, "w").close()
        except OSError:
            self.marker = None

    def signal_group(self, sig):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def next_event(self):
        """When this command next needs attention (its deadline, SIGKILL, the end of draining)."""
        if self.exited_at is not None:
            return self.exited_at + self.drain_s
        return self.kill_at if self.timed_out else self.deadline

    def on_time(self, now):
        if self.exited_at is not None:
            return
        if not self.timed_out and now >= self.deadline:
            self.timed_out = True
            self.signal_group(signal.SIGTERM)
            self.kill_at = now + self.grace_s
        elif self.kill_at is not None and now >= self.kill_at:
            self.signal_group(signal.SIGKILL)
            self.kill_at = None  # nothing left to do but wait for the exit

    def on_exit(self, now):
        code = self.proc.returncode
        self.exit_code = 128 - code if code < 0 else code
        self.exited_at = now
        self.signal_group(signal.SIGKILL)  # background processes do not outlive their command
        if self.marker:
            with contextlib.suppress(OSError):
                os.unlink(self.marker)

    def finished(self, now):
        """Done once it exited and its pipes closed (or stayed open past the drain time)."""
        return self.exited_at is not None and (not self.open or now >= self.exited_at + self.drain_s)

    def result(self):
        exit_code = None if self.timed_out else self.exit_code
        return end_body(exit_code, self.timed_out, [capture.parts() for capture in self.streams])


class Server:
    def __init__(self):
        self.selector = selectors.DefaultSelector()
        self.commands = {}
        self.inbox = bytearray()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the selector
        signal.set_wakeup_fd(wake_w)
        os.set_blocking(0, False)
        self.selector.register(0, selectors.EVENT_READ, "stdin")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")

    def send(self, kind, cid, body=b""):
        data = HEADER.pack(len(body), ord(kind), cid) + body
        while data:
            data = data[os.write(1, data) :]

    def serve(self):
        while True:
            now = time.monotonic()
            times = [t for t in (c.next_event() for c in self.commands.values()) if t is not None]
            timeout = max(0.0, min(times) - now) if times else None
            for key, _ in self.selector.select(timeout):
                if key.data == "stdin":
                    if not self.read_requests():
                        return
                elif key.data == "wake":
                    self.drain_wakeups()
                else:
                    self.read_output(key.fd, key.data)
            now = time.monotonic()
            for command in list(self.commands.values()):
                if command.exited_at is None and command.proc.poll() is not None:
                    command.on_exit(now)
                command.on_time(now)
                if command.finished(now):
                    self.finish(command)

    def read_requests(self):
        try:
            chunk = os.read(0, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.inbox += chunk
        while len(self.inbox) >= HEADER.size:
            size, kind, cid = HEADER.unpack_from(self.inbox)
            if len(self.inbox) < HEADER.size + size:
                break
            body = bytes(self.inbox[HEADER.size : HEADER.size + size])
            del self.inbox[: HEADER.size + size]
            self.handle(chr(kind), cid, body)
        return True

    def handle(self, kind, cid, body):
        if kind == "H":
            self.send("H", cid, json.dumps({"pid": os.getpid(), "python": sys.version.split()[0]}).encode())
        elif kind == "R":
            try:
                command = Command(cid, json.loads(body.decode()))
            except OSError as exc:  # no bash, a missing cwd, out of processes
                message = ("patchgym: cannot start the command: %s\n" % exc).encode()
                self.send("E", cid, end_body(126, False, [(b"", b"", 0), (message, b"", 0)]))
                return
            self.commands[cid] = command
            for fd in command.open:
                self.selector.register(fd, selectors.EVENT_READ, command)
        elif kind == "K" and cid in self.commands:
            self.commands[cid].signal_group(signal.SIGKILL)

    def drain_wakeups(self):
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def read_output(self, fd, command):
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if chunk:
            command.open[fd].write(chunk)
        else:
            self.selector.unregister(fd)
            del command.open[fd]

    def finish(self, command):
        for fd in command.open:
            self.selector.unregister(fd)
        command.open.clear()
        command.proc.stdout.close()
        command.proc.stderr.close()
        del self.commands[command.cid]
        self.send("E", command.cid, command.result())

    def shutdown(self):
        for command in self.commands.values():
            command.signal_group(signal.SIGKILL)


def kill_left_behind():
    """Kill the process groups a server that died left running, and forget them."""
    try:
        names = os.listdir(GROUPS_DIR)
    except OSError:
        names = []
    for name in names:
        if name.isdigit():
            with contextlib.suppress(OSError):
                os.killpg(int(name), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(GROUPS_DIR, name))
    with contextlib.suppress(OSError):
        os.makedirs(GROUPS_DIR, exist_ok=True)


def main():
    kill_left_behind()
    server = Server()
    try:
        server.serve()
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
