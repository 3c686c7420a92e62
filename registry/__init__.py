"""The op table of liger-dispatch: every op's spec (signature, input checks) and where each backend
implements it. Importing this module declares everything; backend modules are imported lazily."""

from liger_dispatch import settings
from liger_dispatch.discovery import declare_backend_devices
from liger_dispatch.registry import logprobs, losses, mhc, vocab_parallel
from liger_dispatch.table import declare_op_locations

BACKENDS = ("reference", "triton", "cutedsl", "helion")

# kernel-level op -> module name inside each backend package
KERNEL_MODULES = {
    "ce_loss_and_grad": "ce",
    "jsd_loss_and_grad": "jsd",
    "kl_div_loss_and_grad": "kl_div",
    "mhc_coeff_fwd": "mhc",
    "mhc_coeff_bwd": "mhc",
    "logprobs_stats": "logprobs",
    "logprobs_grad": "logprobs",
    **dict.fromkeys(vocab_parallel.SCHEMAS, "vocab_parallel"),
}

losses.declare()
mhc.declare()
vocab_parallel.declare()
logprobs.declare()
# user-level ops are served through the kernel-level modules they are composed of; a backend's
# whole-op implementation registers itself from one of its modules.
for _op, _module in KERNEL_MODULES.items():
    declare_op_locations(_op, {b: f"liger_dispatch.backends.{b}.{_module}" for b in BACKENDS})


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
