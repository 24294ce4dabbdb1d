"""docs/plugins.md shows what a user really sees when a plugin fails to load.

Real broken plugin distributions (installed metadata + module in a directory on PYTHONPATH) are
loaded by the `patchgym` command in a fresh process; the outputs must equal the guide's blocks
marked `<!-- output: NAME -->`, up to the install path, line numbers inside patchgym, and the list
of known names (which grows with every built-in).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
BLOCK = re.compile(r"<!-- output: ([\w-]+) -->\n```\w*\n(.*?)```", re.DOTALL)


def guide_outputs() -> dict[str, str]:
    return {name: body for name, body in BLOCK.findall(GUIDE.read_text())}


def normalise(text: str) -> str:
    """The text without what varies between machines and versions."""
    line = lambda m: f"(at .../{m[1]}:{'N' if m[1] == 'plugins.py' else m[2]})"  # noqa: E731
    text = re.sub(r"\(at [^()]*/([\w.]+\.py):(\d+)\)", line, text)
    return re.sub(r"known: [^;]*;", "known: ...;", text).strip()


def install_broken(site: Path, dist: str, module: str, source: str) -> None:
    """`dist` 0.3.0 with entry point `dist` = `module`, laid out as pip installs it."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.3.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[patchgym]\n{dist} = {module}\n")


@pytest.fixture
def broken_site(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    site.mkdir()
    missing_dependency = (
        '"""ACME billing plugin, installed without the client library it needs."""\n\n'
        "import acme_billing_client  # not installed\n"
    )
    install_broken(site, "acme-billing", "acme_billing", missing_dependency)
    future_api = (
        '"""A plugin written for a later plugin API."""\n\n'
        "from patchgym.core.plugins import hookimpl\n\n"
        "PATCHGYM_PLUGIN_API = 2\n\n\n"
        "@hookimpl\n"
        "def register_task_sets(register):\n"
        "    pass\n"
    )
    install_broken(site, "acme-next", "acme_next", future_api)
    return site


def patchgym(site: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    """The `patchgym` command in a fresh process with `site` first on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PATCHGYM_PLUGINS", "PATCHGYM_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "patchgym.cli", *args],
        capture_output=True,
        text=True,
        cwd=site.parent,
        env={**env, "COLUMNS": "1000", **env_extra},
        timeout=120,
    )


def test_the_guide_shows_the_errors_a_user_sees(broken_site: Path) -> None:
    shown = guide_outputs()
    listed = patchgym(broken_site, "plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    records = {r["name"]: r for r in json.loads(listed.stdout)["plugins"]}
    for name in ("acme-billing", "acme-next"):
        assert records[name]["status"] == "failed"
        assert normalise(shown[f"record-{name}"]) == normalise(json.dumps(records[name], indent=2))

    unknown = patchgym(broken_site, "tasks", "list", "acme-invoices")
    assert unknown.returncode == 2
    assert normalise(shown["unknown-name"]) == normalise(f"$ patchgym tasks list acme-invoices\n{unknown.stdout}")

    # The guide's way out: block the broken plugins, and nothing fails any more.
    blocked = patchgym(broken_site, "plugins", "--json", PATCHGYM_DISABLE_PLUGINS="acme-billing,acme-next")
    statuses = {r["name"]: r["status"] for r in json.loads(blocked.stdout)["plugins"]}
    assert statuses["acme-billing"] == statuses["acme-next"] == "disabled"
    assert "failed" not in statuses.values()


def test_the_guides_python_blocks_parse() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert len(blocks) >= 5
    for block in blocks:
        ast.parse(block)
