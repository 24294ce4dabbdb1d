"""SWE-bench-style instance rows: loading, normalising, image names and evaluation subsets.

Shared by the `swebench` and `swesmith` task sets. Rows come from local `.json` (a list, or
`{"instances": [...]}`), `.jsonl` or `.parquet` files, or from the Hugging Face hub by
dataset name when the `datasets` package is installed and the network is reachable.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from patchgym.core.errors import ConfigError

LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")
DIFF_TARGET = re.compile(r"^diff --git a/\S+ b/(\S+)$", re.M)


def load_rows(source: str | Path, *, split: str = "test") -> list[dict[str, Any]]:
    """Instance rows from a local file, or from the hub when `source` is not a path."""
    path = Path(source)
    if path.exists():
        return _read_file(path)
    if path.suffix in (".json", ".jsonl", ".parquet") or "/" not in str(source):
        raise ConfigError(f"instance file {str(source)!r} does not exist")
    return _read_hub(str(source), split)


def _read_file(path: Path) -> list[dict[str, Any]]:
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            rows = data.get("instances") if isinstance(data, dict) else data
            if not isinstance(rows, list):
                raise ConfigError(f"{path} must hold a JSON list of instances (or {{'instances': [...]}})")
            return rows
        if path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
            return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"cannot read instances from {path}: {exc}") from exc
    raise ConfigError(f"unsupported instance file {path}: use .json, .jsonl or .parquet")


def _read_hub(name: str, split: str) -> list[dict[str, Any]]:  # pragma: no cover - needs network
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            f"{name!r} is not a local file; loading it from the Hugging Face hub needs `pip install datasets`"
        ) from exc
    try:
        return [dict(row) for row in datasets.load_dataset(name, split=split)]
    except Exception as exc:
        raise ConfigError(f"cannot load dataset {name!r} (split {split!r}) from the hub: {exc}") from exc


def listed_tests(value: Any, field: str, instance_id: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list, whether stored as a list or a JSON string."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError as exc:
            raise ConfigError(f"instance {instance_id!r}: {field} is not a JSON list: {exc}") from exc
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"instance {instance_id!r}: {field} must be a list of test names")
    return list(value)


def require(row: Mapping[str, Any], fields: Sequence[str], source: str) -> None:
    """A `ConfigError` naming the instance and every missing field."""
    missing = [f for f in fields if not row.get(f) and row.get(f) != ""]
    if missing:
        which = row.get("instance_id", "<no instance_id>")
        raise ConfigError(f"instance {which!r} in {source} lacks the field(s) {', '.join(missing)}")


def patch_files(patch: str) -> list[str]:
    """The files a git diff touches (their post-image paths)."""
    return DIFF_TARGET.findall(patch or "")


def _docker_name(text: str) -> str:
    return text.replace("__", "_1776_").lower()


def swebench_image(instance_id: str, *, namespace: str = "swebench", arch: str = "x86_64", tag: str = "latest") -> str:
    """The swebench harness's instance image, named as the harness names it: pulled ones
    `{ns}/sweb.eval.{arch}.{id}:{tag}` with `__` → `_1776_`; with no namespace, a locally
    built one, `sweb.eval.{arch}.{id}:{tag}` (the id only lowercased)."""
    if not namespace:
        return f"sweb.eval.{arch}.{instance_id.lower()}:{tag}"
    return f"{namespace}/sweb.eval.{arch}.{_docker_name(instance_id)}:{tag}"


def swesmith_image(repo: str, commit: str, *, namespace: str = "swebench", arch: str = "x86_64") -> str:
    """SWE-smith's repo snapshot image: `{ns}/swesmith.{arch}.{owner}_1776_{repo}.{commit[:8]}`."""
    owner, _, name = repo.partition("/")
    if not name:
        raise ConfigError(f"repository {repo!r} must be 'owner/name'")
    image = f"swesmith.{arch}.{owner}_1776_{name}.{commit[:8]}".lower()
    return f"{namespace}/{image}" if namespace else image


def stratified_subset(
    rows: Iterable[Mapping[str, Any]], size: int, *, seed: int = 0, key: str = "repo"
) -> list[Mapping[str, Any]]:
    """`size` rows with each `key` value represented in proportion (largest remainders), seeded.

    Deterministic for a given seed and input order; rows keep their input order.
    """
    rows = list(rows)
    if size >= len(rows):
        return rows
    groups: dict[Any, list[int]] = defaultdict(list)
    for index, row in enumerate(rows):
        groups[row.get(key)].append(index)
    quotas = {group: size * len(members) / len(rows) for group, members in groups.items()}
    counts = {group: int(quota) for group, quota in quotas.items()}
    order = sorted(groups, key=lambda g: (-(quotas[g] - counts[g]), str(g)))
    for group in order[: size - sum(counts.values())]:
        counts[group] += 1
    rng = random.Random(seed)
    chosen: set[int] = set()
    for group in sorted(groups, key=str):
        chosen.update(rng.sample(groups[group], counts[group]))
    return [rows[i] for i in sorted(chosen)]
