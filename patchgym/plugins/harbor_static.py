"""The static checks (`patchgym.core.tamper`) on a Harbor agent's changes, read from its container.

A Harbor verifier grades the container in place, so there is no pristine tree to diff against:
the files come from `docker diff` (added or changed), and only those outside system folders
that Python may load are read (Python sources, `.pth`, start-up modules). Their constructs count
whole for an added file; for a changed one the image's version is not at hand, so they count
whole too. Runner configuration is left to the protected paths (`harbor_paths`: pytest reads
its configuration from the ancestors of `/tests`, which is the root)."""

from __future__ import annotations

import base64
import binascii
import io
import posixpath
import shlex
import tarfile
from collections.abc import Iterable

from patchgym.core.grading_shell import GradingRoom
from patchgym.core.tamper import Finding, layout, names, python_source, tamper_findings
from patchgym.core.tree_diff import FileChange

SYSTEM_FOLDERS = (
    "/usr/",
    "/lib",
    "/bin/",
    "/sbin/",
    "/opt/conda/",
    "/proc/",
    "/sys/",
    "/dev/",
    "/var/",
    "/tmp/",
    "/run/",
    "/logs/",
    "/tests/",
    "/solution/",
    "/root/.cache/",
    "/etc/",
)
"""Folders whose changes are not code the verifier loads from the task (the protected paths
cover the parts of them that matter)."""
LEFT_TO_PATHS = frozenset({names.RUNNER_CONFIG, names.RUNNER_ENV})


def candidates(changes: Iterable[tuple[str, int]]) -> list[str]:
    """Added or changed files the static checks read."""
    found = []
    for path, kind in changes:
        if kind == 2 or path.startswith(SYSTEM_FOLDERS) or "/site-packages/" in path or "/dist-packages/" in path:
            continue
        if path.endswith((".py", ".pyw", ".pth")) or layout.is_startup(path) or layout.module_name(path):
            found.append(path)
    return found


async def read_files(room: GradingRoom, paths: list[str], max_bytes: int) -> dict[str, bytes]:
    """The regular files among `paths` (others skipped), read in one command as a tar archive."""
    if not paths:
        return {}
    listed = " ".join(shlex.quote(p) for p in paths)
    select = f'for f in {listed}; do [ -f "$f" ] && [ ! -L "$f" ] && printf "%s\\0" "$f"; done'
    script = f"{select} | tar -cf - --null -T - 2>/dev/null | base64 -w0"
    done = await room.run(script, timeout_s=120, max_output_bytes=max_bytes * 4 // 3 + 4096)
    try:
        data = base64.b64decode(done.stdout.strip(), validate=True)
    except binascii.Error:
        data = b""
    files: dict[str, bytes] = {}
    if not data:
        return files
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            if member.isfile():
                extracted = archive.extractfile(member)
                if extracted is not None:
                    files["/" + member.name.lstrip("/")] = extracted.read()
    return files


async def existing(room: GradingRoom, paths: Iterable[str]) -> set[str]:
    """Which of `paths` exist in the container."""
    listed = " ".join(shlex.quote(p) for p in sorted(set(paths)))
    if not listed:
        return set()
    done = await room.run(f'for f in {listed}; do [ -e "$f" ] && echo "$f"; done; true', timeout_s=60)
    return set(done.stdout.split())


async def harbor_findings(
    room: GradingRoom, changes: list[tuple[str, int]], max_bytes: int
) -> tuple[list[Finding], int]:
    """(findings, files read) for a container's `docker diff` entries."""
    paths = candidates(changes)
    files = await read_files(room, paths, max_bytes)
    added = {path for path, kind in changes if kind == 1}
    inits = {posixpath.join(posixpath.dirname(p), "__init__.py") for p in paths}
    inits |= {posixpath.join(posixpath.dirname(posixpath.dirname(p)), "__init__.py") for p in paths}
    present = {p.lstrip("/") for p in await existing(room, inits)}
    pristine = {p.lstrip("/") for p, kind in changes if kind == 0} | (present - {p.lstrip("/") for p in added})
    file_changes = [
        FileChange(path.lstrip("/"), None if path in added else b"", data) for path, data in sorted(files.items())
    ]
    missing = [path for path in paths if path not in files]
    findings = [f for f in tamper_findings(file_changes, pristine=pristine) if f.what not in LEFT_TO_PATHS]
    findings += [
        Finding(p.lstrip("/"), 0, "could not be read for the static checks", p)
        for p in missing
        if python_source.is_python(p, None)
    ]
    return [Finding("/" + f.path, f.line, f.what, f.text) for f in findings], len(files)
