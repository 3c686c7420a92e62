"""The op table: declared ops, their backend locations, registered implementations, discovery.

Backend modules are imported lazily, once (discovery.py); an import failure is recorded (and shown by
`python -m liger_dispatch`) instead of breaking other backends.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Optional

from liger_dispatch.capability import Capability
from liger_dispatch.core import results
from liger_dispatch.errors import RegistrationError, SignatureError, UnknownOpError
from liger_dispatch.core.schema import Args, OpSchema

REFERENCE = "reference"
WHOLE_OP = "whole-op"


class TensorSpec:
    """The shape and dtype of a tensor a composition will make, for a kernel predicate to judge (probe)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self.shape, self.dtype = shape, dtype

    def dim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, eq=False)
class OpSpec:
    """An abstract op: its schema (written once) and what the dispatcher needs to serve it.

    schema_text: the op in torch.library syntax, which names it. Every implementation's signature must be the
        schema's (plus `impl_extra`), checked at registration.
    check: check(a), `a` the bound arguments (defaults filled in), raises InputError naming the bad argument. It
        reads shapes, dtypes and options only (it also runs while torch.compile traces); checks that need tensor
        values are `value_check`, run where the op runs.
    composed_of / compose: a user-level op built from kernel-level ops; every backend implementing all of
        `composed_of` serves it through `compose(*kernel_fns)`.
    probe: probe(a) -> (args, kwargs) of the kernel call the composition will make, a TensorSpec standing for each
        tensor it will make, for the kernel's capability predicate to judge.
    differentiable: for user-level ops, the tensor parameters that get gradients.
    impl_extra: keyword-only parameters (schema syntax) a user-level op's implementations take beyond its schema.
    autocast: the tensor parameters cast to the autocast dtype under torch.autocast, as for F.linear.
    fake: fake(a) -> the outputs as empty tensors (torch.compile traces with it). A fused-linear loss's first
        output is the loss, the others statistics without a gradient (empty where the call does not ask for them).
    result: result(a, outputs) -> what a handle's call returns (default: the outputs, a single one as itself).
    saved: for a user-level op whose implementation has a `backward` method, what it returns after the outputs for
        that backward, as schema parameters ("Tensor mix, ...").
    grads_in_saved: grads_in_saved(a, saved) -> {input name: its gradient as a view of the saved tensors}, for a
        backward that writes gradients into what it saved. The torch op's backward returns those empty (a torch
        op's outputs alias no input) and its autograd takes the views.
    logits_grad: logits_grad(a) -> bool, for a loss whose implementations compute its gradients in the forward pass
        and take `logits_grad` (registry/heads.LOGITS_GRAD), its first two differentiable tensors an input [..., H]
        and a weight [V, H]: whether a call traced by torch.compile asks for the logits' gradient [N, V] in the
        weight gradient's place. Its backward then makes the weight's gradient with one GEMM, grad_loss applied to
        the input, where scaling a saved [V, H] gradient in place costs inductor a copy of it.
    vocab_parallel: a user-level loss's compose.vocab_parallel.VocabParallel, where it has that path.
    tuning: a user-level op's tuning.points.Tuning (buckets, the points to time), where tuned tables order it.
    internal: an op the machinery calls (registry/support.py): backend preferences do not apply to it."""

    schema_text: str
    level: str  # "user" or "kernel"
    check: Callable[[Args], None]
    value_check: Optional[Callable[[Args], None]] = None
    aliases: tuple[str, ...] = ()
    composed_of: tuple[str, ...] = ()
    compose: Optional[Callable] = None
    probe: Optional[Callable[[Args], tuple[tuple, dict]]] = None
    differentiable: tuple[str, ...] = ()
    impl_extra: str = ""
    fake: Optional[Callable[[Args], object]] = None
    result: Optional[Callable[[Args, tuple], object]] = None
    autocast: tuple[str, ...] = ()
    saved: str = ""
    grads_in_saved: Optional[Callable[[Args, tuple], dict]] = None
    logits_grad: Optional[Callable[[Args], bool]] = None
    vocab_parallel: Optional[object] = None
    tuning: Optional[object] = None
    internal: bool = False
    summary: str = ""
    schema: OpSchema = field(init=False)
    extra: OpSchema = field(init=False)
    name: str = field(init=False)  # the schema's (an attribute, not a property: calls read it on the per-call path)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schema", OpSchema(self.schema_text))
        object.__setattr__(self, "extra", OpSchema(f"extra(*, {self.impl_extra}) -> ()" if self.impl_extra
                                                   else "extra() -> ()"))
        object.__setattr__(self, "name", self.schema.name)


@dataclass(frozen=True)
class Impl:
    """One implementation of an op by a backend."""

    op: str
    backend: str
    fn: Callable = field(compare=False)
    priority: int
    capability: Capability
    variant: str = WHOLE_OP  # or "composed from <kernel ops>"


class OpTable:
    """Every declared op, where each backend implements it, and the registered implementations. `version` changes with
    every write and `version_of(op)` with every write that concerns op (a declaration, or a registration of it or of an
    op it is composed of), so remembered plans never outlive one."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ops: dict[str, OpSpec] = {}
        self._aliases: dict[str, str] = {}
        self._locations: dict[str, dict[str, str]] = {}
        self._registered: dict[str, list[Impl]] = {}
        self._backend_names: dict[str, None] = {REFERENCE: None}  # ordered set
        self._module_errors: dict[str, Optional[str]] = {}  # module -> None (imported) or why not
        self._discovered: set[tuple[str, str]] = set()  # (op, backend) whose modules were imported
        self._candidates: dict[str, tuple[Impl, ...]] = {}
        self._composed: dict[tuple, Impl] = {}
        self.version = 0
        self._declarations = 0
        self._op_versions: dict[str, int] = {}  # op -> registrations that concern it

    # -- declaring -----------------------------------------------------------------------------
    def declare_op(self, spec: OpSpec) -> None:
        with self._lock:
            self._ops[spec.name] = spec
            self._aliases.update(dict.fromkeys(spec.aliases, spec.name))
            self._declared()

    def declare_op_locations(self, op: str, locations: dict[str, str]) -> None:
        with self._lock:
            name = self.canonical(op)
            self._locations.setdefault(name, {}).update(locations)
            self._backend_names.update(dict.fromkeys(locations))
            self._discovered.clear()  # user-level ops composed of `op` must look again too
            self._declared()

    def register(self, impl: Impl, replace: bool = False) -> None:
        """Add an implementation; a second one of the same (op, backend, variant) is an error unless `replace`."""
        spec = self.spec(impl.op)
        try:
            spec.schema.validate(impl.fn, tuple(spec.extra.signature.parameters.values()),
                                 where=f"{impl.backend}'s implementation of {spec.name}")
        except SignatureError as exc:
            raise SignatureError(f"{exc}. {contract(spec)}") from None
        with self._lock:
            impl = Impl(spec.name, impl.backend, impl.fn, impl.priority, impl.capability, impl.variant)
            registered = self._registered.get(impl.op, [])
            same = [i for i in registered if (i.backend, i.variant) == (impl.backend, impl.variant)]
            if same and not replace and same[0].fn is not impl.fn:
                raise RegistrationError(f"backend {impl.backend!r} already registered {same[0].fn.__qualname__} as its "
                                        f"implementation of {spec.name}; pass replace=True to replace it")
            self._registered[impl.op] = [*(i for i in registered if i not in same), impl]
            self._backend_names.setdefault(impl.backend, None)
            for name in (spec.name, *(n for n, s in self._ops.items() if spec.name in s.composed_of)):
                self._op_versions[name] = self._op_versions.get(name, 0) + 1
                self._candidates.pop(name, None)
            self.version += 1

    def _declared(self) -> None:
        self._candidates.clear()
        self._declarations += 1
        self.version += 1

    def version_of(self, op: str) -> tuple[int, int]:  # op: a canonical name
        return self._declarations, self._op_versions.get(op, 0)

    # -- looking up ----------------------------------------------------------------------------
    def canonical(self, op: str) -> str:
        if op in self._ops:
            return op
        if op not in self._aliases:
            raise UnknownOpError(f"unknown op '{op}'; declared ops: {', '.join(sorted(self._ops))}")
        return self._aliases[op]

    def spec(self, op: str) -> OpSpec:
        spec = self._ops.get(op)  # a canonical name: one lookup (the machinery's own calls name their ops so)
        return spec if spec is not None else self._ops[self.canonical(op)]

    def op_names(self, level: Optional[str] = None) -> list[str]:
        return [n for n, s in self._ops.items() if level is None or s.level == level]

    def backend_names(self) -> list[str]:
        return list(self._backend_names)

    def declaring_backends(self, op: str) -> list[str]:
        """Backends with a declared location for `op` or for an op it is composed of."""
        name = self.canonical(op)
        declared = {b for needed in (name, *self._ops[name].composed_of) for b in self._locations.get(needed, {})}
        return [b for b in self._backend_names if b in declared]

    def locations(self, op: str) -> dict[str, str]:
        return dict(self._locations.get(self.canonical(op), {}))

    # -- discovery -----------------------------------------------------------------------------
    def discover(self, op: str, backends: Optional[Collection[str]] = None) -> None:
        """Import, once, the modules `backends` (default: all) declare for `op` and for the ops it is composed of.
        Outside the lock: a backend module registers into this table while it imports, and another thread may be
        importing it already (Python's import lock makes this one wait for it)."""
        name = self.canonical(op)
        with self._lock:
            pending = [(backend, module) for needed in (name, *self._ops[name].composed_of)
                       for backend, module in self._locations.get(needed, {}).items()
                       if (name, backend) not in self._discovered and (backends is None or backend in backends)]
        for _, module in pending:
            self._import(module)
        with self._lock:
            self._discovered.update((name, backend) for backend, _ in pending)

    def _import(self, module: str) -> None:
        if module in self._module_errors:  # recorded once its import has finished
            return
        try:
            importlib.import_module(module)
            error = None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # any failure of a backend module (SystemExit too) must not break the others
            error = (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]
        with self._lock:
            self._module_errors.setdefault(module, error)

    def module_error(self, module: str) -> Optional[str]:
        return self._module_errors.get(module)

    def unavailable_reason(self, op: str, backend: str) -> str:
        """Why `backend` has no implementation of `op` (after discovery)."""
        name = self.canonical(op)
        spec = self._ops[name]
        for needed in (name, *spec.composed_of):
            module = self._locations.get(needed, {}).get(backend)
            if module and self._module_errors.get(module):
                return f"{module} failed to import ({self._module_errors[module]})"
        if spec.composed_of:
            missing = [k for k in spec.composed_of if not self._impl_of(k, backend)]
            return f"implements neither {name} nor {', '.join(missing)}"
        return f"implements no {name}"

    # -- candidates ----------------------------------------------------------------------------
    def _impl_of(self, op: str, backend: str) -> Optional[Impl]:
        return min((i for i in self._registered.get(op, []) if i.backend == backend), key=lambda i: i.priority,
                   default=None)

    def candidates(self, op: str, backends: Optional[Collection[str]] = None) -> tuple[Impl, ...]:
        """Every implementation of `op`, whole-op and composed, best priority first, after discovering the
        modules of `backends` (default: all); implementations registered by other means are included."""
        name = self.canonical(op)
        self.discover(name, backends)
        cached = self._candidates.get(name)
        if cached is not None:
            return cached
        with self._lock:
            spec = self._ops[name]
            impls = list(self._registered.get(name, []))
            if spec.composed_of:
                for backend in self._backend_names:
                    parts = [self._impl_of(k, backend) for k in spec.composed_of]
                    if all(parts):
                        impls.append(self._compose(spec, backend, parts))
            # whole-op implementations before the composition of the same priority
            impls.sort(key=lambda i: (i.priority, i.variant != WHOLE_OP))
            self._candidates[name] = tuple(impls)
            return self._candidates[name]

    def _compose(self, spec: OpSpec, backend: str, parts: list[Impl]) -> Impl:
        key = (spec.name, backend, tuple(id(p.fn) for p in parts))
        impl = self._composed.get(key)
        if impl is None:
            first = parts[0]
            for part in parts[1:]:  # the composition answers for all of its parts with the first one's terms
                if (part.capability, part.priority) != (first.capability, first.priority):
                    raise ValueError(f"backend {backend!r} registers {part.op} and {first.op} with different "
                                     f"capabilities or priorities; a composed {spec.name} needs them equal")
            capability = replace(first.capability, predicate=_probed(first.capability.predicate, spec))
            checked = [_checked_part(self.spec(p.op), p) for p in parts]
            impl = self._composed[key] = Impl(spec.name, backend, spec.compose(*checked), first.priority, capability,
                                              variant="composed from " + " + ".join(spec.composed_of))
        return impl


def contract(spec: OpSpec) -> str:
    """What an implementation of spec takes and returns, in words (the SignatureError prints it)."""
    takes = f"An implementation of {spec.name} takes {spec.name}{spec.schema.describe()}"
    if spec.impl_extra:
        takes += f" and, keyword-only after them, {spec.extra.describe().strip('()').lstrip('*, ')}"
    if spec.level == "kernel" or not spec.differentiable:
        return (f"{takes}; it returns what the schema returns (checked against the op's fake on each signature's "
                "first call).")
    if "need_grads" in spec.extra.names:
        grads = ", ".join(f"the gradient of {n}" for n in spec.differentiable)
        outputs = spec.schema.returns
        returned = ("the loss," if outputs == 1 else f"its {outputs} outputs, the loss first, a statistic the call "
                    "does not ask for as an empty tensor;")
        weights = ("; with row_weights, the loss is sum_i row_weights_i * loss_i" if "row_weights" in spec.extra.names
                   else "")
        return (f"{takes}; it returns ({returned} {grads}): each gradient computed in the forward pass when "
                f"need_grads asks for it, else None{weights}.")
    return (f"{takes}; it returns the schema's outputs followed by what its backward needs ({spec.saved}), and has a "
            "backward(...) method taking the inputs, those tensors and one gradient per output.")


def _checked_part(spec: OpSpec, part: Impl) -> Callable:
    """A composition's kernel-level implementation: its results checked against the op's fake on a plan's first call."""
    fn = part.fn

    def kernel(*args, **kwargs):
        out = fn(*args, **kwargs)
        if results.active() and spec.fake is not None:
            results.check(spec.name, part.backend, spec.fake(spec.schema.bind(args, kwargs)), out)
        return out

    return kernel


def _probed(predicate: Optional[Callable], spec: OpSpec) -> Optional[Callable]:
    """A kernel-level capability predicate, asked about the kernel call a user-level call will make."""
    if predicate is None or spec.probe is None:
        return None

    def judge(*args, **kwargs):
        kernel_args, kernel_kwargs = spec.probe(spec.schema.bind(args, kwargs))
        return predicate(*kernel_args, **kernel_kwargs)

    return judge


TABLE = OpTable()


def declare_op_locations(op: str, locations: dict[str, str]) -> None:
    """Declare where each backend's implementation of `op` lives (module paths, imported lazily)."""
    TABLE.declare_op_locations(op, locations)


def register_backend(op: str, *, backend: str, priority: int = 50, capability: Optional[Capability] = None,
                     variant: str = WHOLE_OP, replace: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated function as `backend`'s implementation of `op` (a second registration of
    the same op and backend is an error unless `replace=True`)."""
    def decorate(fn: Callable) -> Callable:
        TABLE.register(Impl(op, backend, fn, priority, capability or Capability(), variant), replace=replace)
        return fn

    return decorate
