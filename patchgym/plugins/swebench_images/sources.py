"""Local repository sources: a clone or a bare mirror per repository, read with git.

Nothing is fetched from GitHub. A source must hold the row's `base_commit` (and, for specs that
install a requirements file, its `environment_setup_commit`). The image gets a one-commit
checkout (`git fetch --depth 1` of the base commit from the source), so it carries no later
history, as the harness's own clean-up intends.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from patchgym.core.errors import ConfigError
from patchgym.plugins.swebench_images.recipe import ReadFile


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


@dataclass(frozen=True)
class RepoSources:
    """Where each repository's source is: `paths` (owner/name -> path) first, then
    `{repos_dir}/{owner}__{name}` (with or without `.git`)."""

    paths: Mapping[str, Path]
    repos_dir: Path | None = None

    def path(self, repo: str) -> Path:
        """The source of `repo`, or a `ConfigError` saying how to give one."""
        if repo in self.paths:
            found = Path(self.paths[repo])
            if not found.exists():
                raise ConfigError(f"the source given for {repo} does not exist: {found}")
            return found
        if self.repos_dir is not None:
            name = repo.replace("/", "__")
            for candidate in (self.repos_dir / name, self.repos_dir / f"{name}.git"):
                if candidate.exists():
                    return candidate
        where = f" (nor {self.repos_dir}/{repo.replace('/', '__')})" if self.repos_dir else ""
        raise ConfigError(f"no repository source for {repo}{where}: give --repo-source {repo}=PATH (a clone or mirror)")

    def require_commit(self, repo: str, commit: str) -> Path:
        """The source of `repo`, checked to hold `commit`."""
        source = self.path(repo)
        if _git("-C", str(source), "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            raise ConfigError(f"the source of {repo} ({source}) does not hold commit {commit}: fetch it there first")
        return source

    def reader(self, repo: str) -> ReadFile:
        """A `ReadFile` for `repo`: the text of a path at a commit, None if absent there."""
        source = self.path(repo)

        def read(commit: str, path: str) -> str | None:
            self.require_commit(repo, commit)
            shown = _git("-C", str(source), "show", f"{commit}:{path}")
            return shown.stdout if shown.returncode == 0 else None

        return read


def checkout(source: Path, repo: str, commit: str, target: Path) -> None:
    """A git repository at `target` holding only `commit` (checked out, detached), with an
    `origin` remote that names GitHub but is never contacted (the harness's script removes it)."""
    steps = (
        ("init", "-q", str(target)),
        ("-C", str(target), "fetch", "-q", "--depth", "1", str(source.resolve()), commit),
        ("-C", str(target), "-c", "advice.detachedHead=false", "checkout", "-q", "--detach", commit),
        ("-C", str(target), "remote", "add", "origin", f"https://github.com/{repo}"),
    )
    for step in steps:
        done = _git(*step)
        if done.returncode != 0:
            raise ConfigError(f"cannot check out {repo} at {commit} from {source}: {done.stderr.strip()[-500:]}")
