"""Every op as a PyTorch op, `torch.ops.liger_dispatch.<op>`, and the eager path into the same implementations.

One autograd.Function per kind of op (a loss with its gradients computed in the forward pass, its per-row form, an
op with a backward of its own) serves both ways in:
- eager (a dispatch handle outside torch.compile: `plan` on a signature's first call, its `launch` on the next ones):
  select, then call the implementation under the op's autograd.Function. Going through the torch.library dispatcher
  costs ~20 us more host time per call, more than a loss op's whole host budget.
- traced (`call`, while torch.compile traces a handle): torch.ops.liger_dispatch.<op>, an opaque op with a fake
  implementation, whose autograd kernel runs the same autograd.Function around the op below autograd. Its
  implementation selects when it runs, so `use_backend`, LIGER_BACKEND and a handle's `backend=` (the op's `backend`
  argument) hold in compiled code too.
A backward that changes what its forward kept (a loss scales its gradients in place, the log-prob op's backward
overwrites its logits buffer) runs once (`_once`); in compiled code functionalization keeps the graph correct.
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Optional

import torch
from torch._library.utils import fill_defaults

import liger_dispatch.registry  # noqa: F401  (declares the ops defined below)
from liger_dispatch.compose import vocab_parallel
from liger_dispatch.core import calls, results, selection
from liger_dispatch.core.calls import Plan
from liger_dispatch.compose.fused_linear import grad_dtype, wanted_grads
from liger_dispatch.core.schema import Args
from liger_dispatch.core.table import TABLE, WHOLE_OP, OpSpec
from liger_dispatch.errors import DoubleBackwardError

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


# -- autograd: one definition per kind of op, for eager and traced calls ----------------------------------------------
def once_differentiable(op: str) -> None:
    """In a backward: a double backward (create_graph=True) is an error naming the op, not a gradient that silently
    does not depend on the inputs (the backward runs with grad mode on exactly then)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise DoubleBackwardError(f"liger_dispatch: {op} computes its gradient in the forward pass (or with a kernel "
                                  "of its own), so it cannot be differentiated twice (create_graph=True); compute a "
                                  "gradient penalty with another op")


def _once(ctx, what: str) -> None:
    """A backward that changes what its forward kept runs once: a second one (retain_graph=True) is an error."""
    if getattr(ctx, "done", False):
        raise RuntimeError(f"liger_dispatch: {what}, so it cannot be backpropagated twice (retain_graph=True); call "
                           "the op again instead")
    ctx.done = True


def _returned(results: tuple, outputs: int, returned: int) -> tuple:
    """An op's `outputs`, then up to `returned` (a torch op returns what it saves) an empty tensor for each saved one:
    autograd owns those, and a backward that changes one must not change a tensor the caller holds."""
    return (*results[:outputs], *(results[0].new_empty(0) for _ in range(returned - outputs)))


def _wanted(grads, needs) -> tuple:
    """Each gradient where its input needs one, else None (not the empty tensor a torch op returns there)."""
    return tuple(g if need else None for g, need in zip(grads, needs))


class _GradsInForward(torch.autograd.Function):
    """A loss whose implementation computes its gradients in the forward pass: `run()` returns its outputs, then one
    gradient per differentiable input; the function returns the first `returned`, only the loss with a gradient.
    The backward scales the gradients by grad_loss in place with scale_grad (registry/support.py), which returns at
    once when grad_loss, read on the device, is 1 (loss.backward()): testing it on the host is a sync, and scaling a
    [V, H] weight gradient is a full read and write of it (~0.5 ms at a 128k x 4k head).
    With `logits_grad` (OpSpec.logits_grad) the weight's place holds the logits' gradient G [N, V] instead, and the
    backward makes the weight's gradient G.T @ (grad_loss x), x the input flattened: no [V, H] tensor is scaled."""

    @staticmethod
    def forward(ctx, op, run, scale, outputs, returned, logits_grad, *tensors):
        results = run()
        ctx.save_for_backward(*results[outputs:], *(tensors[:1] if logits_grad else ()))
        ctx.op, ctx.scale, ctx.logits_grad = op, scale, logits_grad
        if returned == 1:
            return results[0]
        returning = _returned(results, outputs, returned)
        ctx.mark_non_differentiable(*returning[1:])
        return returning

    @staticmethod
    def backward(ctx, grad_loss, *_):
        once_differentiable(ctx.op)
        _once(ctx, f"{ctx.op} scales the gradients it computed in the forward pass in place")
        saved = ctx.saved_tensors
        grads = list(_wanted(saved, ctx.needs_input_grad[6:]))
        for place, grad in enumerate(grads):
            if grad is None:
                continue
            if ctx.logits_grad and place == 1:
                x = saved[-1]
                grads[1] = torch.mm(grad.t(), (x.reshape(-1, x.shape[-1]) * grad_loss).to(grad.dtype))
            else:
                ctx.scale(place, grad, grad_loss)
        return None, None, None, None, None, None, *grads


class _RowLosses(torch.autograd.Function):
    """Per-row losses (reduction="none"): `run()` returns them and the op's statistics (the first `returned`
    results); the backward recomputes the gradient of sum_i grad_i * loss_i with `backward(grad_rows, needs)`."""

    @staticmethod
    def forward(ctx, op, run, backward, returned, *tensors):
        ctx.run_backward, ctx.op = backward, op
        rows = run()
        ctx.mark_non_differentiable(*rows[1:returned])
        return rows[0] if returned == 1 else tuple(rows[:returned])

    @staticmethod
    def backward(ctx, grad_rows, *_):
        once_differentiable(ctx.op)
        needs = ctx.needs_input_grad[4:]
        return None, None, None, None, *_wanted(ctx.run_backward(grad_rows, needs), needs)


class _WithBackward(torch.autograd.Function):
    """An op whose implementation has a backward of its own: `run()` returns its `outputs`, then what that backward
    needs (OpSpec.saved); the function returns the first `returned`. `backward(saved, grads, needs)` gives one
    gradient per differentiable tensor, at `where` among the inputs; `once`: it overwrites what the forward kept."""

    @staticmethod
    def forward(ctx, op, run, backward, outputs, returned, where, once, *tensors):
        results = run()
        ctx.save_for_backward(*tensors, *results[outputs:])
        ctx.op, ctx.run_backward, ctx.outputs, ctx.where, ctx.once = op, backward, outputs, where, once
        returning = _returned(results, outputs, returned)
        ctx.mark_non_differentiable(*returning[outputs:])
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return returning

    @staticmethod
    def backward(ctx, *grads):
        once_differentiable(ctx.op)
        if ctx.once:
            _once(ctx, f"{ctx.op}'s backward overwrites what its forward kept")
        first = 7
        need = tuple(ctx.needs_input_grad[first + i] for i in ctx.where)
        result = [None] * (len(ctx.needs_input_grad) - first)  # one per input tensor
        for i, g in zip(ctx.where, _wanted(ctx.run_backward(ctx.saved_tensors, grads[:ctx.outputs], need), need)):
            result[i] = g
        return None, None, None, None, None, None, None, *result


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


# -- eager ----------------------------------------------------------------------------------------------------------
def _plan(spec: OpSpec, pinned: tuple[str, ...], a: Args, args: tuple, kwargs: dict) -> Plan:
    """Selection for a call: what serves it (for a call with a process_group, the vocab-parallel driver on the
    selected implementation) and its fallback warning or None."""
    impl, fallback = selection.selected(spec.name, pinned, args, kwargs)
    fn = impl.fn if spec.level == "kernel" else vocab_parallel.serving(spec, impl, a, pinned)
    composition = impl.variant != WHOLE_OP or fn is not impl.fn  # composed, or the vocab-parallel driver's
    if composition and _grads_in_forward(spec):
        fn = calls.keeping(fn, calls.Kernels())  # its valid_rows selected once per signature
    return Plan(fn, fallback, impl.backend)


def _expected(spec: OpSpec, args: tuple, kwargs: dict):
    """What an implementation of spec returns for this call: the fake's outputs, and for a loss whose gradients are
    computed in the forward pass one gradient per differentiable input (None where not asked for)."""
    a = spec.schema.bind(args, {k: v for k, v in kwargs.items() if k not in spec.extra.names})
    outputs = spec.fake(a)
    if spec.level == "kernel" or not _grads_in_forward(spec):
        return outputs
    need = wanted_grads(kwargs.get("need_grads", ()), len(spec.differentiable))
    inputs = [getattr(a, n) for n in spec.differentiable]
    grads = [results.Like(t.shape, grad_dtype(t), t.device) if w and t is not None else None
             for w, t in zip(need, inputs)]
    if kwargs.get("logits_grad"):
        grads[1] = results.Like(_logits_shape(inputs), inputs[1].dtype, inputs[1].device)
    return (*_as_tuple(outputs), *grads)


def _logits_shape(inputs) -> tuple[int, int]:
    """[N, V] of a loss's input [..., H] and weight [V, H] (OpSpec.logits_grad)."""
    return math.prod(inputs[0].shape[:-1]), inputs[1].shape[0]  # not Size.numel(): it specializes a symbolic N


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _checking(spec: OpSpec, backend: str, fn: Callable) -> Callable:
    """What a plan's first call runs: fn, its results (and its composition's kernels') checked against the fakes."""

    def first_call(*args, **kwargs):
        with results.checking():
            out = fn(*args, **kwargs)
        if spec.fake is not None and kwargs.get("row_weights") is None:  # a loss per row's backward: gradients only
            results.check(spec.name, backend, _expected(spec, args, kwargs), out)
        return out

    if hasattr(fn, "backward"):  # an op with a backward of its own
        first_call.backward = fn.backward
    return first_call


def plan(spec: OpSpec, pinned: tuple[str, ...], a: Args, args: tuple, kwargs: dict) -> Plan:
    """The eager path's first half: select and check values; the plan whose `launch` runs the calls of this one's
    signature (the first with its results checked)."""
    made = _plan(spec, pinned, a, args, kwargs)
    calls.checked(spec, made, a)
    scales = calls.Kernels()  # the backward's, shared by the first call and the later ones
    launch = _launcher(spec, made.fn, a, scales)
    first = _launcher(spec, _checking(spec, made.backend, made.fn), a, scales)

    def first_launch(a, args, kwargs):
        made.launch = launch
        return first(a, args, kwargs)

    made.launch = first_launch
    return made


def _launcher(spec: OpSpec, fn: Callable, a: Args, scales: calls.Kernels) -> Callable[[Args, tuple, dict], object]:
    """launch(a, args, kwargs): how fn serves the calls of a's signature (which gradients, which autograd.Function),
    decided once; `scales`: where the backward keeps its gradients' scale_grad."""
    if spec.level == "kernel":
        return lambda a, args, kwargs: fn(*args, **kwargs)
    need = _needs(spec, a)
    if not _grads_in_forward(spec):
        return _with_backward(spec, fn, a, any(need))
    outputs = spec.schema.returns
    own_outputs = _own_outputs(outputs)
    if not any(need):
        return lambda a, args, kwargs: own_outputs(fn(*args, **kwargs))
    tensors = operator.attrgetter(*spec.differentiable)  # a tuple: a user-level loss has several
    if _row_losses(a):
        def launch_rows(a, args, kwargs):
            def backward(grad_rows, needs):
                return fn(*args, **{**kwargs, "reduction": "sum"}, need_grads=needs, row_weights=grad_rows)[outputs:]

            return _apply(_RowLosses, (spec.name, lambda: fn(*args, **kwargs), backward, outputs), tensors(a))

        return launch_rows
    scale_spec = TABLE.spec("scale_grad")

    def scale(place, grad, grad_loss):  # each gradient's scale_grad selected once per signature
        scales.run(place, scale_spec, (grad, grad_loss), {})

    return lambda a, args, kwargs: _apply(_GradsInForward, (spec.name, lambda: fn(*args, **kwargs, need_grads=need),
                                                            scale, outputs, outputs, False), tensors(a))


def _own_outputs(count: int) -> Callable[[tuple], object]:
    """From what an implementation returns, the op's own outputs: the first alone, or a tuple of `count`."""
    return operator.itemgetter(0) if count == 1 else lambda results: tuple(results[:count])


def _with_backward(spec: OpSpec, fn: Callable, a: Args, grads: bool) -> Callable[[Args, tuple, dict], object]:
    """launch for an op whose implementation has a backward of its own: its options, when no tensor is among them,
    are the same in every call of the signature, so they are read once."""
    positional = operator.attrgetter(*spec.schema.positional)  # a tuple: such an op has several tensors
    outputs = spec.schema.returns
    where = _differentiable_places(spec)
    once = _overwrites_saved(spec)
    fixed = spec.schema.call_args(a)[1]
    if any(isinstance(v, torch.Tensor) for v in fixed.values()):
        fixed = None

    def launch(a, args, kwargs):
        tensors = positional(a)
        options = fixed if fixed is not None else spec.schema.call_args(a)[1]
        if not grads:
            return fn(*tensors, **options)[:outputs]

        def backward(saved, grad_outputs, needs):
            return fn.backward(*saved, *grad_outputs, need_grads=needs, **options)

        return _apply(_WithBackward, (spec.name, lambda: fn(*tensors, **options), backward, outputs, outputs, where,
                                      once), tensors)

    return launch


# -- torch.library ----------------------------------------------------------------------------------------------------
def _split(schema_text: str) -> tuple[list[str], list[str], str]:
    """A schema's (positional parameters, keyword-only parameters, returns), as text."""
    head, _, returns = schema_text.rpartition("->")
    params = [p.strip() for p in head.strip()[head.index("(") + 1:-1].split(",") if p.strip()]
    star = params.index("*") if "*" in params else len(params)
    return params[:star], params[star + 1:], returns.strip()


def _op_schema(name: str, positional: list[str], keyword: list[str], returns: str) -> str:
    """A torch op's schema, whose last keyword-only parameter is `str? backend=None`."""
    return f"{name}({', '.join([*positional, '*', *keyword, 'str? backend=None'])}) -> {returns}"


def _torch_schema(spec: OpSpec, returns: Optional[str] = None) -> str:
    """The op's schema plus its implementations' extra parameters (the tensors among them before the `*`: torch's
    autograd takes tensor arguments only there) and, keyword-only, `str? backend=None`; with other returns if given."""
    positional, keyword, own_returns = _split(spec.schema_text)
    extra = [p.strip() for p in spec.impl_extra.split(",") if p.strip()]
    tensors, others = [p for p in extra if p.startswith("Tensor")], [p for p in extra if not p.startswith("Tensor")]
    return _op_schema(spec.name, [*positional, *tensors], [*keyword, *others], returns or own_returns)


def _bind(spec: OpSpec, args: tuple, kwargs: dict) -> tuple[Args, tuple[str, ...], dict]:
    """A torch op's arguments as (the op's own bound arguments, the pinned backends, the extra keyword values)."""
    kwargs = dict(kwargs)
    pinned = selection.parse_backends(kwargs.pop("backend", None))
    own = len(spec.schema.positional)
    extra = dict(zip((p.name for p in spec.extra.params if p.is_tensor), args[own:]))  # positional: the tensors
    extra.update((name, kwargs.pop(name)) for name in spec.extra.names if name in kwargs)
    return spec.schema.bind(args[:own], kwargs), pinned, extra


def _unaliased(outputs: tuple, inputs: tuple) -> tuple:
    """The outputs, each one that shares memory with an input or an earlier output, or starts off a 16-byte boundary,
    cloned: a torch op's outputs may alias neither, and inductor asserts they are aligned (a backend may hand out
    views into one buffer its kernel fills at once)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    result = []
    for out in outputs:
        if isinstance(out, torch.Tensor):
            if not out.numel():  # an empty one aliases only itself: one tensor returned twice
                out = out.new_empty(out.shape) if any(out is r for r in result) else out
            elif out.untyped_storage().data_ptr() in seen or out.data_ptr() % 16:
                out = out.clone()
            seen.add(out.untyped_storage().data_ptr())
        result.append(out)
    return tuple(result)


def _tensors(count: int) -> str:
    """A schema's returns: `count` tensors."""
    return "(" + ", ".join(["Tensor"] * count) + ")"


def _define(name: str, schema: str, impl: Callable, fake: Callable):
    """torch.ops.liger_dispatch.<name>, with its implementation and fake; its default overload."""
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(torch.ops.liger_dispatch, name).default


def _run(spec: OpSpec, args: tuple, kwargs: dict) -> tuple[Args, tuple, dict, object]:
    """A torch op's call of its signature's plan, after its fallback warning and value checks: (bound arguments,
    positional values, extra keyword values, result)."""
    a, pinned, extra = _bind(spec, args, kwargs)
    positional, options = spec.schema.call_args(a)
    plan, first = _planned(spec, pinned, a, positional, options)
    calls.checked(spec, plan, a)
    fn = _checking(spec, plan.backend, plan.fn) if first else plan.fn
    return a, positional, extra, fn(*positional, **options, **extra)


def _planned(spec: OpSpec, pinned: tuple[str, ...], a: Optional[Args], args: tuple, kwargs: dict
             ) -> tuple[Plan, bool]:
    """The plan of a torch op's call signature, and whether this call made it (then it is remembered); `a`, the bound
    arguments, is bound here when None and the plan is new."""
    call_key = calls.key(spec, pinned, args, kwargs)
    plan = calls.get(call_key)
    if plan is not None:
        return plan, False
    a = a if a is not None else spec.schema.bind(args, kwargs)
    plan = _plan(spec, pinned, a, args, kwargs)
    calls.remember(call_key, plan, getattr(a, "process_group", None))
    return plan, True


def _define_as_returned(spec: OpSpec, returns: Optional[str] = None):
    """An op that returns what its implementation returns: a kernel-level op, or an op with a backward of its own
    (its outputs, then what that backward needs: `returns`)."""

    def impl(*args, **kwargs):
        _, positional, _, out = _run(spec, args, kwargs)
        return _unaliased(out, positional) if isinstance(out, tuple) else out

    def fake(*args, **kwargs):
        return spec.fake(_bind(spec, args, kwargs)[0])

    return _define(spec.name, _torch_schema(spec, returns), impl, fake)


def _define_loss(spec: OpSpec) -> None:
    """A fused-linear loss: its outputs, then a gradient per differentiable input (empty where need_grads omits it)."""
    count = len(spec.differentiable)
    returned = spec.schema.returns

    def outputs(a, need, results, grads):  # a gradient not asked for: an empty tensor (of its input, if given)
        inputs = (getattr(a, n) for n in spec.differentiable)
        return *results, *(g if g is not None and w else (t if t is not None else results[0]).new_empty(0)
                           for g, w, t in zip(grads, wanted_grads(need, count), inputs))

    def impl(*args, **kwargs):
        a, positional, extra, results = _run(spec, args, kwargs)
        return _unaliased(outputs(a, extra.get("need_grads", ()), results[:returned], results[returned:]), positional)

    def fake(*args, **kwargs):
        a, _, extra = _bind(spec, args, kwargs)
        need = wanted_grads(extra.get("need_grads", ()), count)
        inputs = [getattr(a, n) for n in spec.differentiable]
        grads = [torch.empty_like(t, dtype=grad_dtype(t)) if w else None for w, t in zip(need, inputs)]
        if extra.get("logits_grad"):
            grads[1] = inputs[1].new_empty(_logits_shape(inputs))
        return outputs(a, need, _as_tuple(spec.fake(a)), grads)

    op = _define(spec.name, _torch_schema(spec, _tensors(returned + count)), impl, fake)
    own = len(spec.schema.positional)

    def under_autograd(run, args, kwargs, tensors):
        if kwargs.get("reduction") == "none" and "row_weights" in spec.extra.names:
            def backward(grad_rows, needs):  # row_weights: the first tensor after the op's own
                return op(*args[:own], grad_rows, **{**kwargs, "reduction": "sum", "need_grads": needs})[returned:]

            return _RowLosses.apply(spec.name, run, backward, returned + count, *tensors)
        return _GradsInForward.apply(spec.name, run, _scale, returned, returned + count,
                                     bool(kwargs.get("logits_grad")), *tensors)

    _register_autograd(spec, op, under_autograd)


def _scale(place: int, grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    torch.ops.liger_dispatch.scale_grad(grad, grad_loss)


def _register_autograd(spec: OpSpec, op, under_autograd: Callable) -> None:
    """The torch op's autograd: a call with an input that requires a gradient runs `under_autograd(run, args, kwargs,
    tensors)` (the op kind's autograd.Function), whose `run` is the op below autograd."""
    where = _differentiable_places(spec)

    def autograd_kernel(keyset, *args, **kwargs):
        def run():
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

        tensors = tuple(args[i] if i < len(args) else None for i in where)  # the dispatcher drops trailing defaults
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
            return run()
        args, kwargs = fill_defaults(op._schema, args, kwargs)
        return under_autograd(run, args, kwargs, tensors)

    _LIB.impl(spec.name, autograd_kernel, "Autograd", with_keyset=True)


def _overwrites_saved(spec: OpSpec) -> bool:
    """Whether the op's backward overwrites a tensor its forward saved (declared "Tensor(a!)" in OpSpec.saved)."""
    return "(a!)" in spec.saved


def _differentiable_places(spec: OpSpec) -> list[int]:
    return [spec.schema.positional.index(n) for n in spec.differentiable]


def _grad_or_empty(grad: Optional[torch.Tensor], input: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The gradient of an input in its shape and dtype, or an empty tensor for an input left out or a grad None."""
    if input is None or grad is None:
        return like.new_empty(0)
    # whatever the input's strides, contiguous: the fake's; each step only where it changes something (~2 us a
    # gradient of dispatcher calls otherwise)
    if grad.shape != input.shape:
        grad = grad.reshape(input.shape)
    if grad.dtype != input.dtype:
        grad = grad.to(input.dtype)
    return grad if grad.is_contiguous() else grad.contiguous()


def _define_with_backward(spec: OpSpec) -> None:
    """An op whose implementation has a backward of its own: it returns the op's outputs, then what spec.saved names;
    its backward is a second op, `<name>_backward`, taking the op's positional inputs, the saved tensors and one
    optional gradient per output, and returning one gradient per differentiable input."""
    backward_name = f"{spec.name}_backward"
    positional = spec.schema.positional
    outputs = spec.schema.returns
    saved = [p.strip() for p in spec.saved.split(",")]
    op = _define_as_returned(spec, _tensors(outputs + len(saved)))
    own_positional, keyword, _ = _split(spec.schema_text)
    own_positional = [p.partition("=")[0].strip() for p in own_positional]  # the backward's come before the saved
    grads = [f"Tensor? grad_{i}" for i in range(outputs)]
    backward_schema = _op_schema(backward_name, [*own_positional, *saved, *grads], [*keyword, "bool[] need_grads"],
                                 _tensors(len(spec.differentiable)))
    keyword_defaults = {n: spec.schema.defaults[n] for n in spec.schema.names[len(positional):]}
    where = _differentiable_places(spec)

    def views_in_saved(args: tuple, options: dict) -> dict:
        """{a gradient's place: the view of a saved tensor it is} (OpSpec.grads_in_saved), from the backward op's
        arguments (the op's inputs, then the saved tensors)."""
        if spec.grads_in_saved is None:
            return {}
        a = spec.schema.bind(args[:len(positional)], {k: v for k, v in options.items() if k in keyword_defaults})
        views = spec.grads_in_saved(a, args[len(positional):len(positional) + len(saved)])
        return {spec.differentiable.index(name): view for name, view in views.items()}

    def backward_impl(*args, need_grads, backend=None, **options):
        options = {**keyword_defaults, **options}  # the dispatcher drops arguments equal to their defaults
        tensors = args[: len(positional)]
        pinned = selection.parse_backends(backend)
        plan, _ = _planned(spec, pinned, None, tensors, options)  # no warning again: the forward gave it
        grads = plan.fn.backward(*args, need_grads=tuple(need_grads), **options)
        views = views_in_saved(args, options)
        # an input left out (None), one not needing a gradient or one whose gradient is a view of a saved tensor
        # (its autograd takes that view) gets an empty tensor: a torch op returns tensors that alias no input
        return _unaliased(tuple(_grad_or_empty(g if w and k not in views else None, tensors[i], args[0])
                                for k, (i, g, w) in enumerate(zip(where, grads, need_grads))), args)

    def backward_fake(*args, need_grads, backend=None, **options):  # contiguous, as _grad_or_empty makes them
        views = views_in_saved(args, {**keyword_defaults, **options})
        return tuple(args[0].new_empty(0) if args[i] is None or not w or k in views
                     else args[i].new_empty(args[i].shape) for k, (i, w) in enumerate(zip(where, need_grads)))

    backward_op = _define(backward_name, backward_schema, backward_impl, backward_fake)
    once = _overwrites_saved(spec)

    def under_autograd(run, args, kwargs, tensors):
        def backward(saved_tensors, grad_outputs, needs):
            grads = list(backward_op(*saved_tensors, *grad_outputs, need_grads=list(needs), **kwargs))
            for place, view in views_in_saved(saved_tensors, kwargs).items():  # written by the backward op
                grads[place] = view
            return grads

        returned = outputs + len(saved)
        return _WithBackward.apply(spec.name, run, backward, outputs, returned, where, once, *args[:len(positional)])

    _register_autograd(spec, op, under_autograd)


_defined: set[str] = set()


def define(spec: OpSpec) -> None:
    """Define torch.ops.liger_dispatch.<op> for a declared op (once)."""
    if spec.name in _defined:
        return
    _defined.add(spec.name)
    if spec.level == "kernel":
        _define_as_returned(spec)
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
    if options.get("process_group") is not None:  # the op takes a group by its name
        options["process_group"] = vocab_parallel.group_name(options["process_group"])
    if _grads_in_forward(spec):
        need = [] if _row_losses(a) else list(_needs(spec, a))
        if spec.logits_grad is not None and need[1:2] == [True] and spec.logits_grad(a):
            options["logits_grad"] = True
        return _own_outputs(spec.schema.returns)(op(*positional, **options, need_grads=need, backend=backend))
    return op(*positional, **options, backend=backend)[:spec.schema.returns]


for _spec in (TABLE.spec(name) for name in TABLE.op_names()):
    define(_spec)
