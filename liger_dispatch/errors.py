"""The errors and warnings liger-dispatch raises."""

import os
import sys
import warnings


class LigerDispatchError(RuntimeError):
    """Base class of the dispatcher's own errors."""


class UnknownOpError(LigerDispatchError, KeyError):
    """No op of that name (or alias) is declared."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class UnknownBackendError(LigerDispatchError, ValueError):
    """A backend name nobody registered was asked for (a typo in LIGER_BACKEND, say)."""


class BackendUnavailableError(LigerDispatchError):
    """A requested backend cannot serve the call and LIGER_STRICT=1 forbids falling back."""


class ConfigError(LigerDispatchError, ValueError):
    """An environment variable liger-dispatch reads holds a value it does not accept (the message names both)."""


class InputError(ValueError):
    """An op was called with bad input; the message names the argument."""


class FallbackWarning(UserWarning):
    """A requested (or better) backend could not serve a call, and another one did."""


class RegistrationError(LigerDispatchError, ValueError):
    """A registration that would silently replace another one, or names what does not exist."""


class BackendError(LigerDispatchError):
    """What an implementation returned does not match its op's contract (the message names the op, the backend and
    what differs)."""


class DoubleBackwardError(LigerDispatchError):
    """A double backward (create_graph=True) through an op whose gradient is computed in the forward pass."""


class SignatureError(LigerDispatchError, TypeError):
    """A registered implementation's signature does not match its op's schema."""


_internal: tuple[str, ...] = ()


def warn_at_caller(message: str, category: type) -> None:
    """warnings.warn pointing at the first frame outside liger_dispatch and torch: the user's line, however deep the
    call (an nn module's forward runs under torch.nn.Module.__call__)."""
    global _internal
    if not _internal:
        import torch

        import liger_dispatch.backends
        import liger_dispatch.registry

        packages = (sys.modules["liger_dispatch"], liger_dispatch.registry, liger_dispatch.backends, torch)
        _internal = tuple(os.path.dirname(p.__file__) + os.sep for p in packages)
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
