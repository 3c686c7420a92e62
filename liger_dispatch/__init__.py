"""liger-dispatch: one abstract op, several backends (Triton, CuTeDSL, Helion, eager PyTorch reference),
selected per call by the inputs' device, compute capability and dtype.

    from liger_dispatch import dispatch
    loss = dispatch.op("flce")(x, lm_head.weight, labels)
"""

from liger_dispatch import dispatch
from liger_dispatch.capability import Capability
from liger_dispatch.dispatch import available_backends, op, registered_backends
from liger_dispatch.errors import (BackendError, BackendUnavailableError, ConfigError, FallbackWarning, InputError,
                                   LigerDispatchError, RegistrationError, UnknownBackendError, UnknownOpError)
from liger_dispatch.core.selection import use_backend
from liger_dispatch.core.table import declare_op_locations, register_backend
from liger_dispatch import registry  # noqa: E402  (declares every op; imports no backend)
from liger_dispatch.registry.cross_entropy import CrossEntropyOutput  # noqa: E402

__all__ = [
    "dispatch", "op", "available_backends", "registered_backends", "use_backend", "register_backend",
    "declare_op_locations", "Capability", "LigerDispatchError", "UnknownOpError", "UnknownBackendError",
    "BackendUnavailableError", "BackendError", "RegistrationError", "ConfigError", "InputError", "FallbackWarning",
    "CrossEntropyOutput", "nn",
]


def __getattr__(name):
    if name == "nn":  # modules import torch.nn; keep `import liger_dispatch` light
        import importlib

        return importlib.import_module("liger_dispatch.nn")
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("liger-dispatch")
        except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
            return "0+unknown"
    raise AttributeError(f"module 'liger_dispatch' has no attribute {name!r}")
