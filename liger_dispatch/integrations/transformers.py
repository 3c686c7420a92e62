"""Hugging Face transformers: `patch(model)` makes a causal LM compute its loss with `flce`, never the logits.

    from liger_dispatch.integrations.transformers import patch
    model = patch(AutoModelForCausalLM.from_pretrained(...))     # this instance only; unpatch(model) undoes it
    out = model(input_ids, labels=labels)                         # out.loss by flce; out.logits is None

With labels, the wrapped forward runs the model's own with labels=None and a `logits_to_keep` that keeps no
position, takes the final hidden states by a hook on its base model, and computes HF's loss from them
(`causal_lm.causal_lm_loss`, the family's final_logit_softcapping as softcap). No part of HF's forward is
copied: it must take `labels` and `logits_to_keep`, run `model.base_model` once and project with the output
embeddings, which is checked when patching and on every call. Without labels, or with `return_logits=True`, the
forward runs untouched; `return_token_accuracy=True` (liger-kernel's option) adds the output field `token_accuracy`.
`distillation_loss(student, teacher, ...)` is TRL's GKD loss between two such models.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any, Optional, Union

import torch
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.utils import ModelOutput

from liger_dispatch.errors import LigerDispatchError
from liger_dispatch.integrations.causal_lm import causal_lm_loss
from liger_dispatch.integrations.distillation import generalized_jsd_loss

# The ForCausalLM classes whose logits are lm_head(final hidden states), softcapped by the config attribute
# named here (None: no softcap), and whose loss is ForCausalLMLoss. Add a family after reading its forward.
FAMILIES: dict[str, Optional[str]] = {
    "LlamaForCausalLM": None,
    "MistralForCausalLM": None,
    "Qwen2ForCausalLM": None,
    "Qwen3ForCausalLM": None,
    "Phi3ForCausalLM": None,
    "GemmaForCausalLM": None,
    "Gemma2ForCausalLM": "final_logit_softcapping",
    "Gemma3ForCausalLM": "final_logit_softcapping",
}
_STATE = "_liger_dispatch_patch"


class UnsupportedModelError(LigerDispatchError, TypeError):
    """The model's head or loss is not one the fused loss reproduces: patching it would change its loss."""


@dataclasses.dataclass(frozen=True)
class _Patch:
    """What patch() keeps on the instance: the forward it wraps, that forward's signature, the options."""

    original: Any  # the forward found on the instance (a bound method; deepcopy rebinds it to the copy)
    signature: inspect.Signature
    var_keyword: str  # the name of the forward's **kwargs
    softcap_attr: Optional[str]
    backend: Optional[str]


def patch(model, *, backend: Optional[str] = None):
    """Patches a causal-LM instance in place (see the module docstring) and returns it.

    backend: pins the flce backend for this model (None: the usual selection). Patching again replaces the
    options; `unpatch` restores. Raises UnsupportedModelError for a model whose loss would change.
    """
    family = _family(model)
    previous = vars(model).get(_STATE)
    original = previous.original if previous is not None else model.forward
    signature = inspect.signature(original)
    params = signature.parameters
    missing = [name for name in ("labels", "logits_to_keep") if name not in params]
    var_keyword = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if missing or var_keyword is None:
        raise UnsupportedModelError(f"{type(model).__name__}.forward takes no {' / '.join(missing or ['**kwargs'])}")
    _check_head_and_loss(model)
    setattr(model, _STATE, _Patch(original, signature, var_keyword, FAMILIES[family], backend))
    model.forward = types.MethodType(_forward_exposing(signature), model)
    return model


def unpatch(model):
    """Restores the forward patch() wrapped and returns the model."""
    state = vars(model).pop(_STATE, None)
    if state is None:
        raise ValueError(f"this {type(model).__name__} is not patched")
    if (getattr(state.original, "__self__", None) is model  # the class's own forward: drop our attribute
            and getattr(state.original, "__func__", None) is type(model).forward):
        del model.forward
    else:
        model.forward = state.original
    return model


def _patched_forward(self, *args, return_logits: bool = False, return_token_accuracy: bool = False, **kwargs):
    state: _Patch = vars(self)[_STATE]
    call = state.signature.bind(*args, **kwargs)
    arguments = call.arguments
    labels = arguments.get("labels")
    if labels is None or return_logits:
        return state.original(*args, **kwargs)
    _check_head_and_loss(self)
    keep = arguments.get("logits_to_keep", state.signature.parameters["logits_to_keep"].default)
    extra = dict(arguments.get(state.var_keyword, {}))
    # the output is rebuilt by field name: ask for a ModelOutput, and make the caller's tuple from it
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    head = self.get_output_embeddings()
    arguments.update(labels=None, logits_to_keep=_no_position(head.weight.device))
    arguments[state.var_keyword] = {**extra, "return_dict": True}
    outputs, hidden = _with_final_hidden_states(self, state.original, *call.args, **call.kwargs)
    if not (isinstance(outputs, ModelOutput) and {"loss", "logits"} <= {f.name for f in dataclasses.fields(outputs)}):
        raise UnsupportedModelError(f"{type(self).__name__}.forward returned a {type(outputs).__name__}, "
                                    "not a ModelOutput with loss and logits")
    softcap = getattr(self.config, state.softcap_attr) if state.softcap_attr else None
    loss = causal_lm_loss(_keep_positions(hidden, keep), head.weight, labels, head.bias,
                          shift_labels=extra.get("shift_labels"), num_items_in_batch=extra.get("num_items_in_batch"),
                          ignore_index=extra.get("ignore_index", -100), softcap=softcap, backend=state.backend,
                          return_token_accuracy=return_token_accuracy)
    if return_token_accuracy:
        fields = {f.name: getattr(outputs, f.name) for f in dataclasses.fields(outputs)}
        outputs = _with_token_accuracy(type(outputs))(**fields)
        outputs.token_accuracy, loss = loss.token_accuracy, loss.loss
    outputs = dataclasses.replace(outputs, loss=loss, logits=None)
    return outputs if return_dict else outputs.to_tuple()


@functools.cache
def _with_token_accuracy(output_class: type) -> type:
    """output_class (a ModelOutput) with a `token_accuracy` field after its own, as liger-kernel's
    LigerCausalLMOutputWithPast (a tuple output ends with it)."""
    namespace = {"__annotations__": {"token_accuracy": Optional[torch.FloatTensor]}, "token_accuracy": None}
    return dataclasses.dataclass(type(output_class.__name__, (output_class,), namespace))


def _forward_exposing(signature: inspect.Signature):
    """_patched_forward under the wrapped forward's signature (plus return_logits), for callers that inspect it
    (transformers' Trainer keeps only the dataset columns the forward names)."""
    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    params = list(signature.parameters.values())  # ends with **kwargs (patch checks): keyword-only goes before
    for name in ("return_logits", "return_token_accuracy"):
        params.insert(len(params) - 1, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False))
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_param, *params])
    forward.__doc__ = "The model's forward, its loss computed by liger-dispatch's flce when labels are given."
    return forward


def final_hidden_states(model, **inputs) -> torch.Tensor:
    """[..., T, H]: what the lm_head of a supported causal LM projects, from the model's own forward, which is
    run with no position kept for the logits (so no [..., T, V] tensor is made). `inputs` are the forward's
    keywords (input_ids, attention_mask, ...), without labels."""
    _family(model)
    if "labels" in inputs or "logits_to_keep" in inputs:
        raise TypeError("final_hidden_states takes no labels or logits_to_keep: it returns every position")
    no_logits = _no_position(model.get_output_embeddings().weight.device)
    return _with_final_hidden_states(model, model, **inputs, logits_to_keep=no_logits)[1]


def distillation_loss(student, teacher, labels: Optional[torch.Tensor] = None, *, beta: float = 0.5,
                      temperature: float = 1.0, alpha: float = 0.0,
                      num_items_in_batch: Union[None, int, torch.Tensor] = None, ignore_index: int = -100,
                      backend: Optional[str] = None, **inputs) -> torch.Tensor:
    """TRL's GKD loss (distillation.generalized_jsd_loss) of `student` against `teacher` on the same inputs.

    Both are supported causal LMs sharing a vocabulary, without an lm_head bias or a softcap (fused_linear_jsd has
    neither); the teacher runs under no_grad (put it in eval mode yourself, as TRL does). `labels` [..., T] are
    unshifted; `inputs` are the forwards' keywords (input_ids, attention_mask).
    """
    student_weight = _distillation_head(student, "student")
    teacher_weight = _distillation_head(teacher, "teacher")
    student_hidden = final_hidden_states(student, **inputs)
    with torch.no_grad():
        teacher_hidden = final_hidden_states(teacher, **inputs)
    return generalized_jsd_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta=beta,
                                temperature=temperature, alpha=alpha, num_items_in_batch=num_items_in_batch,
                                ignore_index=ignore_index, backend=backend)


def _family(model) -> str:
    """The supported ForCausalLM class `model` is an instance of (its name), or UnsupportedModelError."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES and cls.__module__.startswith("transformers."):
            if type(model).forward is not cls.forward:
                raise UnsupportedModelError(f"{type(model).__name__} overrides {cls.__name__}.forward; the fused "
                                            f"loss reproduces only the latter")
            return cls.__name__
    raise UnsupportedModelError(f"{type(model).__name__} is not a supported causal LM (supported: "
                                f"{', '.join(FAMILIES)}); patch the transformers model itself, before wrapping it")


def _check_head_and_loss(model) -> None:
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise UnsupportedModelError(f"{type(model).__name__}'s lm_head is a {type(head).__name__}, not a "
                                    "torch.nn.Linear (LoRA or quantized?): the fused loss reads its weight directly")
    if model.base_model is model:
        raise UnsupportedModelError(f"{type(model).__name__} has no base model to take the hidden states from")
    if model.loss_function is not ForCausalLMLoss:
        raise UnsupportedModelError(f"{type(model).__name__}.loss_function is {model.loss_function!r}, not "
                                    "transformers' ForCausalLMLoss, the only loss the fused path computes")


def lm_head_without_softcap(model, role: str, op: str = "fused_linear_logprobs"):
    """(weight, bias or None) of a supported causal LM's lm_head, for an op with no softcap (refused with why)."""
    softcap_attr = FAMILIES[_family(model)]
    softcap = getattr(model.config, softcap_attr) if softcap_attr else None
    if softcap is not None:
        raise UnsupportedModelError(f"the {role} ({type(model).__name__}) softcaps its logits "
                                    f"({softcap_attr}={softcap}); {op} has no softcap")
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def _distillation_head(model, role: str) -> torch.Tensor:
    weight, bias = lm_head_without_softcap(model, role, "fused_linear_jsd")
    if bias is not None:
        raise UnsupportedModelError(f"the {role}'s lm_head has a bias; fused_linear_jsd has no bias term")
    return weight


def _no_position(device) -> torch.Tensor:
    """A logits_to_keep that keeps no position: the forward's lm_head then projects [batch, 0, H]."""
    return torch.empty(0, dtype=torch.long, device=device)


def _keep_positions(hidden: torch.Tensor, keep: Union[int, torch.Tensor]) -> torch.Tensor:
    """hidden [B, T, H] cut as transformers' logits_to_keep cuts it: an int keeps the last `keep` positions (0:
    all), a 1-D tensor these positions, a 2-D integer tensor per-row positions, a 2-D bool mask the True ones."""
    if isinstance(keep, int):
        return hidden[:, -keep:] if keep else hidden
    if keep.ndim == 2:
        return hidden[keep] if keep.dtype == torch.bool else torch.take_along_dim(hidden, keep[..., None], dim=1)
    return hidden[:, keep]


def _with_final_hidden_states(model, forward, *args, **kwargs) -> tuple[Any, torch.Tensor]:
    """(forward(*args, **kwargs), the first field of the outputs of the one run of model's base model it made:
    last_hidden_state, or a tuple's first item)."""
    kept: list[torch.Tensor] = []
    handle = model.base_model.register_forward_hook(lambda module, args, output: kept.append(output[0]))
    try:
        outputs = forward(*args, **kwargs)
    finally:
        handle.remove()
    if len(kept) != 1:
        raise UnsupportedModelError(f"{type(model).__name__}.forward ran its base model {len(kept)} times, not once")
    return outputs, kept[0]
