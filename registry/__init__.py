"""The op table of liger-dispatch: every op family's declarations, and where each backend implements them.

An op family module (cross_entropy, jsd, kl_div, logprobs, mhc; support: the machinery's own kernels) holds everything that is specific to its ops, read by the
machinery: OPS, their OpSpecs (schemas, checks, fakes, compositions, fp16 bounds, vocab-parallel layouts, tuning),
BACKEND_MODULES, the module of each backend package that implements each kernel-level op, and optionally BACKENDS,
the backends that have those modules (default: all four); and, for liger_dispatch.testing, CASES (the conformance
cases of its user-level ops, by op; cases.py has their pieces) and SAMPLES (the smallest call of each kernel-level
op, by op), both optional (default: none). Importing this module declares everything; backend modules are imported
lazily.
"""

from liger_dispatch import settings
from liger_dispatch.core.discovery import declare_backend_devices
from liger_dispatch.core.table import TABLE, declare_op_locations
from liger_dispatch.registry import cross_entropy, jsd, kl_div, logprobs, mhc, support

BACKENDS = ("reference", "triton", "cutedsl", "helion")
FAMILIES = (cross_entropy, jsd, kl_div, logprobs, mhc, support)

for _family in FAMILIES:
    for _spec in _family.OPS:
        TABLE.declare_op(_spec)
    # user-level ops are served through the kernel-level modules they are composed of; a backend's
    # whole-op implementation registers itself from one of its modules.
    for _op, _module in _family.BACKEND_MODULES.items():
        backends = getattr(_family, "BACKENDS", BACKENDS)
        declare_op_locations(_op, {b: f"liger_dispatch.backends.{b}.{_module}" for b in backends})


def _cuda_or_interpreted(*interpreters: settings.Setting):
    """CUDA, and the CPU while one of these interpreters is switched on."""
    return lambda: ("cuda", "cpu") if any(s.get() for s in interpreters) else ("cuda",)


# The device types each backend can ever accept: a call on other tensors does not import its modules (its DSL).
# The reference accepts any; the capabilities in each backend's _support.py say the rest.
declare_backend_devices("triton", _cuda_or_interpreted(settings.TRITON_INTERPRET),
                        hint="runs on the CPU under TRITON_INTERPRET=1")
declare_backend_devices("helion", _cuda_or_interpreted(settings.TRITON_INTERPRET, settings.HELION_INTERPRET),
                        hint="runs on the CPU under TRITON_INTERPRET=1 or HELION_INTERPRET=1")
declare_backend_devices("cutedsl", lambda: ("cuda",))
