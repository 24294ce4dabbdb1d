"""Conformance suites and checks for plugin authors (and for patchgym's own backends).

- `patchgym.testing.sandbox.SandboxConformance`: the sandbox contract as a pytest test class;
  subclass it and say how to build your backend.
- `patchgym.testing.tasks`: checks that a task set is well formed and that each task's gold
  patch earns reward 1 and the empty patch reward 0.
- `patchgym.testing.inference.InferenceEngineConformance`: the token-in, token-out contract.

They need pytest and pytest-asyncio (`pip install 'patchgym[testing]'`) and work in
pytest-asyncio's strict and auto modes. See docs/plugins.md.
"""
