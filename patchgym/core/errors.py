"""The error hierarchy.

`InfraError` and its subclasses mean "the infrastructure failed": such an episode is never
scored as a wrong answer. Everything the agent does wrong is data (an exit code, a failed
test), not an exception. `ConfigError` means bad input from the user; its message says what
was wrong and what to do.
"""

from __future__ import annotations


class PatchgymError(Exception):
    """Base class of every error patchgym raises on purpose."""


class ConfigError(PatchgymError, ValueError):
    """Bad input: an unknown name, a malformed file, an invalid setting."""


class PluginError(PatchgymError):
    """A plugin could not be loaded, or two plugins claim the same name."""


class InfraError(PatchgymError):
    """A fault of the infrastructure, not of the agent.

    `kind` is a short stable label used in metrics; `retryable` says whether trying the same
    operation again may succeed.
    """

    kind = "infra"
    retryable = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable

    def as_dict(self) -> dict[str, object]:
        """The form reported in `info["infra_error"]` and in run metrics."""
        return {"kind": self.kind, "message": str(self), "retryable": self.retryable}


class SandboxStartError(InfraError):
    """A sandbox could not be created or started."""

    kind = "sandbox_start"
    retryable = True


class SandboxLostError(InfraError):
    """A running sandbox disappeared or stopped answering.

    `from_inside` is set by a backend that can tell that the sandbox ended by its own processes'
    doing (a container that exited or was OOM-killed while nothing on the host stopped it): the
    agent may have caused that, so the episode is scored 0 (`sandbox_killed_by_agent`), never
    retried. Without it the loss is the infrastructure's and the episode may be retried.
    """

    kind = "sandbox_lost"
    retryable = True

    def __init__(self, message: str, *, retryable: bool | None = None, from_inside: bool = False) -> None:
        super().__init__(message, retryable=retryable)
        self.from_inside = from_inside


AGENT_KILLED_SANDBOX = "sandbox_killed_by_agent"
"""The reason of the zero an episode gets when its sandbox ended from inside (`SandboxLostError.from_inside`)."""


class TransportError(InfraError):
    """The connection to a sandbox or service broke."""

    kind = "transport"
    retryable = True


class CapacityError(InfraError):
    """The provider is out of capacity or rate-limited the request."""

    kind = "capacity"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BuildError(InfraError):
    """An image or template could not be built or found."""

    kind = "build"


class EngineError(InfraError):
    """An inference engine failed or is gone (not a wrong answer of the policy)."""

    kind = "engine"
    retryable = True
