"""The entry point: registers ACME's task set, sandbox backend and inference backend.

patchgym imports this module (entry point `acme` in the group `patchgym`) and calls each
registrar hook with `register(name, factory, description)`.
"""

from __future__ import annotations

from patchgym.core.plugins import LazyFactory, Register, hookimpl

from acme_patchgym.sandbox import AcmeSandboxBackend
from acme_patchgym.tasks import LedgerTaskSet

PATCHGYM_PLUGIN_API = 1
"""The plugin API this module was written for; patchgym refuses to load it under another."""


@hookimpl
def register_task_sets(register: Register) -> None:
    register("acme-ledger", LedgerTaskSet, "ACME ledger totals, generated in code (options: count, seed, lines)")


@hookimpl
def register_sandbox_backends(register: Register) -> None:
    register("acme-team", AcmeSandboxBackend, "any sandbox backend under ACME's policy (labels, env, no network)")


@hookimpl
def register_inference_backends(register: Register) -> None:
    # Imported on first use: it needs transformers (for the tokenizer), which `patchgym plugins` does not.
    register(
        "acme-scripted",
        LazyFactory("acme_patchgym.inference:ScriptedEngine", "pip install 'patchgym[train]'"),
        "a scripted policy that solves acme-ledger tasks by reading the sandbox (options: mistake_rate, seed)",
    )
