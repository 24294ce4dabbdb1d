"""Run by the interpreter under test (a wheel install or the editable one): start a sandbox of a
`tiny` task on the backend named by argv[1] and print, as JSON, what attacks on the gold answer read.

Kept a separate script so that a wheel-installed patchgym in another venv is the one exercised."""

from __future__ import annotations

import asyncio
import json
import sys

from patchgym.plugins.folder import TINY_TASKS, load_task

ATTACKS = {
    "find": "find / -name gold.patch -not -path '/proc/*' -not -path '/sys/*' 2>/dev/null | head -5",
    "import": "python3 -c 'import patchgym.plugins.folder as f, pathlib; "
    'print(*sorted(p.read_text() for p in pathlib.Path(f.TINY_TASKS).glob("*/gold.patch")))\' 2>&1',
    "site": "python3 -c 'import site, pathlib; "
    "print(*[p.read_text() for d in site.getsitepackages() "
    'for p in pathlib.Path(d).glob("patchgym/**/gold.patch")])\'',
}


async def main(kind: str) -> None:
    task = load_task(TINY_TASKS / "roman-subtractive")
    gold = (TINY_TASKS / "roman-subtractive" / "gold.patch").read_text()
    marker = next(line for line in gold.splitlines() if line.startswith("+") and len(line) > 12)[1:].strip()
    if kind == "docker":
        from patchgym.backends.sandbox.docker import DockerSandboxBackend

        backend = DockerSandboxBackend(concurrency=2)
    else:
        from patchgym.backends.sandbox.local import LocalSandboxBackend

        backend = LocalSandboxBackend(isolation="bwrap", root_dir=sys.argv[2])
    results = {}
    try:
        sandbox = await backend.create(task.sandbox)
        try:
            for name, command in ATTACKS.items():
                done = await sandbox.exec(command, timeout_s=300)
                found = marker in done.output or "gold.patch" in done.stdout
                results[name] = {"found": found, "out": done.output[:300]}
        finally:
            await sandbox.close()
    finally:
        await backend.aclose()
    print(json.dumps({"package": __import__("patchgym").__file__, "results": results}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
