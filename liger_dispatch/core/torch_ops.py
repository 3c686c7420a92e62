"""Every op as a PyTorch op, `torch.ops.liger_dispatch.<op>`, and the eager path into the same implementations.

Two ways in, one set of implementations:
- eager (`run`, what a dispatch handle does outside torch.compile): select, then call the implementation, under a
  light autograd.Function for the user-level ops. Going through the torch.library dispatcher costs ~20 us more host
  time per call than an autograd.Function, more than a loss op's whole host budget.
- traced (`call`, what a handle does while torch.compile traces it): torch.ops.liger_dispatch.<op>, an opaque op
  with a fake implementation and registered autograd. Its implementation selects when it runs, so `use_backend`,
  LIGER_BACKEND and a handle's `backend=` (passed as the op's `backend` argument) hold in compiled code too.

The torch.library schema of an op is its own schema plus, keyword-only, its implementations' extra parameters and
`str? backend=None`. A fused-linear loss computes its gradients in the forward pass, so its op returns them after
the loss (empty tensors for the ones not asked for by `need_grads`); an op with a backward of its own returns what
its backward needs (OpSpec.saved) after its outputs.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

import liger_dispatch.registry  # noqa: F401  (declares the ops defined below)
from liger_dispatch.registry import support
from liger_dispatch.core import selection
from liger_dispatch.compose import vocab_parallel
from liger_dispatch.core.call_plans import Plan
from liger_dispatch.compose.fused_linear import grad_dtype, wanted_grads
from liger_dispatch.core.schema import Args
from liger_dispatch.core.table import TABLE, OpSpec

NAMESPACE = "liger_dispatch"
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _grads_in_forward(spec: OpSpec) -> bool:
    return "need_grads" in spec.extra.names


def _row_losses(a: Args) -> bool:
    """A loss returned per row (reduction="none"): its backward recomputes with the rows' weights."""
    return getattr(a, "reduction", None) == "none"


def _needs(spec: OpSpec, a: Args) -> tuple[bool, ...]:
    if not torch.is_grad_enabled():
        return ()
    # getattr, not a.__dict__: this also runs while torch.compile traces, and torch 2.11's Dynamo cannot follow it
    return tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in (getattr(a, n) for n in spec.differentiable))


# -- eager ----------------------------------------------------------------------------------------------------------
class _GradsInForward(torch.autograd.Function):
    """loss, with the gradients its implementation computed in the forward pass scaled by grad_loss in the backward."""

    @staticmethod
    def forward(ctx, run, *tensors):
        loss, *grads = run()
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return None, *_scaled(ctx, grad_loss)


class _RowLosses(torch.autograd.Function):
    """Per-row losses; the backward recomputes the gradient of sum_i grad_i * loss_i."""

    @staticmethod
    def forward(ctx, run, backward, *tensors):
        ctx.run_backward = backward
        return run()

    @staticmethod
    def backward(ctx, grad_rows):
        return None, None, *ctx.run_backward(grad_rows, ctx.needs_input_grad[2:])


class _WithBackward(torch.autograd.Function):
    """An op whose implementation has a backward of its own: its first `outputs` results, the rest saved for it."""

    @staticmethod
    def forward(ctx, fn, options, outputs, *tensors):
        results = fn(*tensors, **options)
        ctx.save_for_backward(*tensors, *results[outputs:])
        ctx.fn, ctx.options = fn, options
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return tuple(results[:outputs])

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, *ctx.fn.backward(*ctx.saved_tensors, *grads, **ctx.options)


def _scaled(ctx, grad_loss: torch.Tensor) -> list:
    """ctx's saved gradients (None where not computed) times grad_loss, in place; a second backward raises.

    grad_loss is almost always 1 (loss.backward()), and a scale of a [V, H] weight gradient costs a full read and
    write of it (~0.5 ms at a 128k x 4k head), while testing grad_loss == 1 on the host is a device sync: the
    scale_grad kernel reads it on the device and returns at once when it is 1 (registry/support.py). In place: the
    saved gradients are the op's outputs, and a second backward through the same node (retain_graph=True) is
    refused rather than scaled twice. A backward traced by torch.compile may not change what its forward saved,
    so the torch.library ops scale out of place there (_define_loss)."""
    if getattr(ctx, "scaled", False):
        raise RuntimeError("liger_dispatch: a fused-linear loss computes its gradients in the forward pass and "
                           "scales them in place in the backward, so it cannot be backpropagated twice "
                           "(retain_graph=True); compute the loss again instead")
    ctx.scaled = True
    grads = ctx.saved_tensors
    for g in grads:
        if g is not None:
            support.run("scale_grad", g, grad_loss)
    return list(grads)


_functorch_active = torch._C._are_functorch_transforms_active
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_DIRECT = {f: super(torch.autograd.Function, f).apply for f in (_GradsInForward, _RowLosses, _WithBackward)}


def _apply(function, head: tuple, tensors: tuple):
    """function.apply(*head, *tensors) without torch's Python wrapper (~1 us a call) where that wrapper would change
    nothing: no functorch transform is active and no tensor is a functorch wrapper (it unwraps dead ones)."""
    if _functorch_active():
        return function.apply(*head, *tensors)
    for t in tensors:
        if t is not None and _functorch_wrapped(t):
            return function.apply(*head, *tensors)
    return _DIRECT[function](*head, *tensors)


def _checked(spec: OpSpec, fallback: Optional[Callable[[], None]], a: Args) -> None:
    """What every call runs, remembered or not: its fallback's warning (or error), then the op's value checks."""
    if fallback is not None:
        fallback()
    if spec.value_check is not None:
        spec.value_check(a)


def _selected(spec: OpSpec, pinned: tuple[str, ...], a: Args, args: tuple, kwargs: dict):
    """(what serves this call, its fallback warning or None), both paths: the selected implementation (the
    vocab-parallel driver on it for a call with a process_group), after the op's value checks."""
    impl, fallback = selection.selected(spec.name, pinned, args, kwargs)
    _checked(spec, fallback, a)
    return (impl.fn if spec.level == "kernel" else vocab_parallel.serving(spec, impl, a, pinned)), fallback


def _serving(spec: OpSpec, pinned: tuple[str, ...], a: Args, args: tuple, kwargs: dict):
    return _selected(spec, pinned, a, args, kwargs)[0]


def plan(spec: OpSpec, pinned: tuple[str, ...], a: Args, args: tuple, kwargs: dict) -> Plan:
    """The eager path's first half: select and check values; what calls of this one's signature run."""
    fn, fallback = _selected(spec, pinned, a, args, kwargs)
    return Plan(_launcher(spec, fn, a), fallback)


def replay(spec: OpSpec, plan: Plan, a: Args, args: tuple, kwargs: dict):
    """A call of a signature planned before: its fallback warning and value checks, then the plan."""
    _checked(spec, plan.fallback, a)
    return plan.launch(a, args, kwargs)


def _launcher(spec: OpSpec, fn: Callable, a: Args) -> Callable[[Args, tuple, dict], object]:
    """launch(a, args, kwargs): how fn serves the calls of a's signature (which gradients, which autograd.Function:
    all fixed by the signature), decided once."""
    if spec.level == "kernel":
        return lambda a, args, kwargs: fn(*args, **kwargs)
    need = _needs(spec, a)
    if not _grads_in_forward(spec):
        return _with_backward(spec, fn, a, any(need))
    if not any(need):
        return lambda a, args, kwargs: fn(*args, **kwargs)[0]
    tensors = operator.attrgetter(*spec.differentiable)  # a tuple: a user-level loss has several
    if _row_losses(a):
        def launch_rows(a, args, kwargs):
            def backward(grad_rows, needs):
                summed = {**kwargs, "reduction": "sum"}
                return fn(*args, **summed, need_grads=needs, row_weights=grad_rows)[1:]

            return _apply(_RowLosses, (lambda: fn(*args, **kwargs)[0], backward), tensors(a))

        return launch_rows
    return lambda a, args, kwargs: _apply(_GradsInForward, (lambda: fn(*args, **kwargs, need_grads=need),),
                                          tensors(a))


def _with_backward(spec: OpSpec, fn: Callable, a: Args, grads: bool) -> Callable[[Args, tuple, dict], object]:
    """launch for an op whose implementation has a backward of its own: its options, when no tensor is
    among them, are the same in every call of the signature, so they are read once."""
    positional = operator.attrgetter(*spec.schema.positional)  # a tuple: such an op has several tensors
    outputs = _returns(spec.schema_text)
    fixed = spec.schema.call_args(a)[1]
    if any(isinstance(v, torch.Tensor) for v in fixed.values()):
        fixed = None

    def launch(a, args, kwargs):
        tensors = positional(a)
        options = fixed if fixed is not None else spec.schema.call_args(a)[1]
        return _apply(_WithBackward, (fn, options, outputs), tensors) if grads else fn(*tensors, **options)[:outputs]

    return launch


# -- torch.library ----------------------------------------------------------------------------------------------------
def _split(schema_text: str) -> tuple[list[str], list[str], str]:
    """A schema's (positional parameters, keyword-only parameters, returns), as text."""
    head, _, returns = schema_text.rpartition("->")
    params = [p.strip() for p in head.strip()[head.index("(") + 1:-1].split(",") if p.strip()]
    star = params.index("*") if "*" in params else len(params)
    return params[:star], params[star + 1:], returns.strip()


def _op_schema(name: str, positional: list[str], keyword: list[str], returns: str) -> str:
    params = [*positional, *(["*", *keyword] if keyword else [])]
    return f"{name}({', '.join(params)}) -> {returns}"


def _extras(spec: OpSpec) -> tuple[list[str], list[str]]:
    """The implementations' extra parameters as (tensor ones, the others): torch.library's autograd takes tensor
    arguments only before the `*`."""
    extra = [p.strip() for p in spec.impl_extra.split(",") if p.strip()]
    return [p for p in extra if p.startswith("Tensor")], [p for p in extra if not p.startswith("Tensor")]


def _torch_schema(spec: OpSpec, returns: Optional[str] = None) -> str:
    positional, keyword, own_returns = _split(spec.schema_text)
    tensors, others = _extras(spec)
    return _op_schema(spec.name, [*positional, *tensors], [*keyword, *others, "str? backend=None"],
                      returns or own_returns)


def _bind(spec: OpSpec, args: tuple, kwargs: dict) -> tuple[Args, tuple[str, ...], dict]:
    """A torch op's arguments as (the op's own bound arguments, the pinned backends, the extra keyword values)."""
    kwargs = dict(kwargs)
    pinned = selection.parse_backends(kwargs.pop("backend", None))
    own = len(spec.schema.positional)
    extra = dict(zip((p.name for p in spec.extra.params if p.is_tensor), args[own:]))  # positional: the tensors
    extra.update((name, kwargs.pop(name)) for name in spec.extra.names if name in kwargs)
    return spec.schema.bind(args[:own], kwargs), pinned, extra


def _unaliased(outputs: tuple, inputs: tuple) -> tuple:
    """The outputs, each one that shares memory with an input or an earlier output cloned (a torch op's outputs
    may alias neither)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    result = []
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.numel():
            if out.untyped_storage().data_ptr() in seen:
                out = out.clone()
            seen.add(out.untyped_storage().data_ptr())
        result.append(out)
    return tuple(result)


def _define_kernel(spec: OpSpec) -> None:
    def impl(*args, **kwargs):
        a, pinned, _ = _bind(spec, args, kwargs)
        positional, options = spec.schema.call_args(a)
        out = _serving(spec, pinned, a, positional, options)(*positional, **options)
        return _unaliased(out, positional) if isinstance(out, tuple) else out

    def fake(*args, **kwargs):
        return spec.fake(_bind(spec, args, kwargs)[0])

    _LIB.define(_torch_schema(spec))
    _LIB.impl(spec.name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{spec.name}", fake, lib=_LIB)


def _define_loss(spec: OpSpec) -> None:
    """A fused-linear loss: (loss, one gradient per differentiable input, or an empty tensor when not needed)."""
    count = len(spec.differentiable)

    def outputs(a, need, loss, grads):
        return loss, *(g if g is not None and w else getattr(a, n).new_empty(0) if getattr(a, n) is not None
                       else loss.new_empty(0) for g, w, n in zip(grads, wanted_grads(need, count), spec.differentiable))

    def impl(*args, **kwargs):
        a, pinned, extra = _bind(spec, args, kwargs)
        positional, options = spec.schema.call_args(a)
        loss, *grads = _serving(spec, pinned, a, positional, options)(*positional, **options, **extra)
        return outputs(a, extra.get("need_grads", ()), loss, grads)

    def fake(*args, **kwargs):
        a, _, extra = _bind(spec, args, kwargs)
        need = wanted_grads(extra.get("need_grads", ()), count)
        inputs = [getattr(a, n) for n in spec.differentiable]
        grads = [torch.empty_like(t, dtype=grad_dtype(t)) if w else None for w, t in zip(need, inputs)]
        return outputs(a, need, spec.fake(a), grads)

    where = [spec.schema.positional.index(n) for n in spec.differentiable]  # each one's place among the inputs

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        ctx.rows = keyword_only_inputs.get("reduction") == "none" and "row_weights" in spec.extra.names
        if ctx.rows:
            ctx.inputs, ctx.keywords = inputs, keyword_only_inputs
        else:
            ctx.save_for_backward(*output[1:])
        ctx.mark_non_differentiable(*output[1:])

    def backward(ctx, grad_loss, *_):
        # the dispatcher drops trailing arguments left at their defaults (bias=None): needs_input_grad is shorter
        passed = len(ctx.needs_input_grad)
        need = [i < passed and ctx.needs_input_grad[i] for i in where]
        if ctx.rows:
            keywords = {**ctx.keywords, "reduction": "sum", "need_grads": need}
            own = ctx.inputs[: len(spec.schema.positional)]
            grads = getattr(torch.ops.liger_dispatch, spec.name)(*own, grad_loss, **keywords)[1:]
        else:
            # out of place: a traced backward may not change what the forward saved
            grads = [g * grad_loss.to(g.dtype) if w else None for g, w in zip(ctx.saved_tensors, need)]
        result = [None] * passed
        for i, g, w in zip(where, grads, need):
            if w:
                result[i] = g
        return tuple(result)

    returns = "(" + ", ".join(["Tensor"] * (count + 1)) + ")"
    _LIB.define(_torch_schema(spec, returns))
    _LIB.impl(spec.name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{spec.name}", fake, lib=_LIB)
    torch.library.register_autograd(f"{NAMESPACE}::{spec.name}", backward, setup_context=setup_context, lib=_LIB)


def _returns(schema_text: str) -> int:
    """How many tensors a schema returns."""
    returns = schema_text.rpartition("->")[2].strip()
    return returns.count("Tensor") if returns.startswith("(") else 1


def _define_with_backward(spec: OpSpec) -> None:
    """An op whose implementation has a backward of its own: it returns the op's outputs, then what spec.saved names;
    its backward is a second op, `<name>_backward`, taking the op's positional inputs, the saved tensors and one
    optional gradient per output, and returning one gradient per differentiable input."""
    backward_name = f"{spec.name}_backward"
    positional = spec.schema.positional
    outputs = _returns(spec.schema_text)
    saved = [p.strip() for p in spec.saved.split(",")]

    def impl(*args, **kwargs):
        a, pinned, _ = _bind(spec, args, kwargs)
        positional_args, options = spec.schema.call_args(a)
        fn = _serving(spec, pinned, a, positional_args, options)
        return _unaliased(fn(*positional_args, **options), positional_args)

    def fake(*args, **kwargs):
        return spec.fake(_bind(spec, args, kwargs)[0])

    own_positional, keyword, _ = _split(spec.schema_text)
    _LIB.define(_torch_schema(spec, "(" + ", ".join(["Tensor"] * (outputs + len(saved))) + ")"))
    grads = [f"Tensor? grad_{i}" for i in range(outputs)]
    _LIB.define(_op_schema(backward_name, [*own_positional, *saved, *grads], [*keyword, "str? backend=None"],
                           "(" + ", ".join(["Tensor"] * len(spec.differentiable)) + ")"))

    keyword_defaults = {n: spec.schema.defaults[n] for n in spec.schema.names[len(positional):]}
    where = [positional.index(n) for n in spec.differentiable]  # each one's place among the inputs

    def backward_impl(*args, backend=None, **options):
        options = {**keyword_defaults, **options}  # the dispatcher drops arguments equal to their defaults
        tensors = args[: len(positional)]
        fn = selection.select(spec.name, selection.parse_backends(backend), tensors, options).fn
        grads = fn.backward(*args, **options)
        return tuple(g.reshape(tensors[i].shape).to(tensors[i].dtype) for i, g in zip(where, grads))

    def backward_fake(*args, backend=None, **options):
        return tuple(torch.empty_like(args[i]) for i in where)

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        ctx.save_for_backward(*inputs, *output[outputs:])
        ctx.keywords = keyword_only_inputs
        ctx.mark_non_differentiable(*output[outputs:])
        ctx.set_materialize_grads(False)

    def backward(ctx, *grad_outputs):
        grads = getattr(torch.ops.liger_dispatch, backward_name)(*ctx.saved_tensors, *grad_outputs[:outputs],
                                                                 **ctx.keywords)
        result = [None] * len(positional)
        for i, g in zip(where, grads):
            result[i] = g
        return tuple(result)

    _LIB.impl(spec.name, impl, "CompositeExplicitAutograd")
    _LIB.impl(backward_name, backward_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{spec.name}", fake, lib=_LIB)
    torch.library.register_fake(f"{NAMESPACE}::{backward_name}", backward_fake, lib=_LIB)
    torch.library.register_autograd(f"{NAMESPACE}::{spec.name}", backward, setup_context=setup_context, lib=_LIB)


_defined: set[str] = set()


def define(spec: OpSpec) -> None:
    """Define torch.ops.liger_dispatch.<op> for a declared op (once)."""
    if spec.name in _defined:
        return
    _defined.add(spec.name)
    if spec.level == "kernel":
        _define_kernel(spec)
    elif _grads_in_forward(spec):
        _define_loss(spec)
    else:
        _define_with_backward(spec)


def call(spec: OpSpec, backend: Optional[str], a: Args):
    """The traced path: torch.ops.liger_dispatch.<op> with the call's arguments; the op's own outputs."""
    define(spec)
    positional, options = spec.schema.call_args(a)
    op = getattr(torch.ops.liger_dispatch, spec.name)
    if spec.level == "kernel":
        return op(*positional, **options, backend=backend)
    if _grads_in_forward(spec):
        need = [] if _row_losses(a) else list(_needs(spec, a))
        if options.get("process_group") is not None:  # the op takes a group by its name
            options["process_group"] = vocab_parallel.group_name(options["process_group"])
        return op(*positional, **options, need_grads=need, backend=backend)[0]
    return op(*positional, **options, backend=backend)[:_returns(spec.schema_text)]


for _spec in (TABLE.spec(name) for name in TABLE.op_names()):
    define(_spec)
