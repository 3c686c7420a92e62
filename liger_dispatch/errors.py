"""The errors and warnings liger-dispatch raises."""


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


class InputError(ValueError):
    """An op was called with bad input; the message names the argument."""


class FallbackWarning(UserWarning):
    """A requested (or better) backend could not serve a call, and another one did."""


class SignatureError(LigerDispatchError, TypeError):
    """A registered implementation's signature does not match its op's schema."""
