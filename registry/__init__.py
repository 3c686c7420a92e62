"""The op table of liger-dispatch: every op's spec (signature, input checks) and where each backend
implements it. Importing this module declares everything; backend modules are imported lazily."""

from liger_dispatch.registry import losses, mhc, vocab_parallel
from liger_dispatch.table import declare_op_locations

BACKENDS = ("reference", "triton", "cutedsl", "helion")

# kernel-level op -> module name inside each backend package
KERNEL_MODULES = {
    "ce_loss_and_grad": "ce",
    "jsd_loss_and_grad": "jsd",
    "kl_div_loss_and_grad": "kl_div",
    "mhc_coeff_fwd": "mhc",
    "mhc_coeff_bwd": "mhc",
    **{op: "vocab_parallel" for op in vocab_parallel.OPS},
}

losses.declare()
mhc.declare()
vocab_parallel.declare()
# user-level ops are served through the kernel-level modules they are composed of; a backend's
# whole-op implementation registers itself from one of its modules.
for _op, _module in KERNEL_MODULES.items():
    declare_op_locations(_op, {b: f"liger_dispatch.backends.{b}.{_module}" for b in BACKENDS})
