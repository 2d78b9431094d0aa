"""Exceptions of convt3d (invalid arguments raise PyTorch's own types; see ``convt3d.core.validate``)."""


class BackendUnavailableError(RuntimeError):
    """The backend that was asked for cannot run this call (it never silently runs another)."""
