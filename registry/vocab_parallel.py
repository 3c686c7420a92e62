"""Op specs of the vocab-parallel kernel-level ops (issue 11): per-row statistics of this rank's vocabulary
slice, and the gradient pass that takes the statistics combined over ranks.

Placeholder declarations with the ops' signatures; the input checks live on the branch that owns this file.
"""

from liger_dispatch.table import TABLE, OpSpec


def check_ce_vp_stats(logits, target, *, vocab_start=0, ignore_index=-100, softcap=None):
    """No checks yet."""


def check_ce_vp_grad(logits, target, lse, *, vocab_start=0, vocab_size=0, grad_scale=None, ignore_index=-100,
                     label_smoothing=0.0, softcap=None, lse_square_scale=0.0):
    """No checks yet."""


def check_jsd_vp_stats(student_logits, teacher_logits, labels=None, *, ignore_index=-100, temperature=1.0):
    """No checks yet."""


def check_jsd_vp_sums(student_logits, teacher_logits, lse, labels=None, *, beta=0.5, ignore_index=-100,
                      temperature=1.0):
    """No checks yet."""


def check_jsd_vp_grad(student_logits, teacher_logits, lse, sums, labels=None, *, beta=0.5, ignore_index=-100,
                      temperature=1.0, grad_scale=None):
    """No checks yet."""


def check_kl_div_vp_stats(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                          log_target=False):
    """No checks yet."""


def check_kl_div_vp_grad(student_logits, target, lse, target_sum, labels=None, *, ignore_index=-100,
                         temperature=1.0, log_target=False, grad_scale=None):
    """No checks yet."""


OPS = {
    "ce_vp_stats": check_ce_vp_stats,
    "ce_vp_grad": check_ce_vp_grad,
    "jsd_vp_stats": check_jsd_vp_stats,
    "jsd_vp_sums": check_jsd_vp_sums,
    "jsd_vp_grad": check_jsd_vp_grad,
    "kl_div_vp_stats": check_kl_div_vp_stats,
    "kl_div_vp_grad": check_kl_div_vp_grad,
}


def declare() -> None:
    for name, check in OPS.items():
        TABLE.declare_op(OpSpec(name, "kernel", check))
