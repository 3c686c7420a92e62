"""An op's schema, written once in torch.library syntax, and what follows from it: the signature every
implementation must have, the binding of a call's arguments (`Args`), the torch.library op (core/torch_ops.py).

    ce_loss_and_grad(Tensor(a!) logits, Tensor target, *, Tensor? grad_scale=None, int ignore_index=-100) -> Tensor
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from liger_dispatch.errors import SignatureError

_EMPTY = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # torch's name of the type: "Tensor", "Optional[Tensor]", "float", ...
    keyword_only: bool
    default: Any = _EMPTY

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Optional[Tensor]")


class Args:
    """One call's arguments by name, defaults filled in: what an op's checks and probes read (a.input, ...). Set
    attribute by attribute: torch.compile traces this, and some of its versions cannot follow an assignment of __dict__
    or a SimpleNamespace(**values)."""

    def __init__(self, values: dict):
        for name, value in values.items():
            setattr(self, name, value)


class OpSchema:
    """A parsed schema: the op's name, its parameters in order, and how to bind and validate against them."""

    def __init__(self, text: str):
        parsed = torch._C.parse_schema(text)
        self.text = text
        self.name = parsed.name
        self.params = tuple(Param(a.name, str(a.type), a.kwarg_only,
                                  a.default_value if a.has_default_value() else _EMPTY) for a in parsed.arguments)
        self.names = tuple(p.name for p in self.params)
        self.positional = tuple(p.name for p in self.params if not p.keyword_only)
        self.defaults = {p.name: p.default for p in self.params if p.default is not _EMPTY}
        self.required = tuple(p.name for p in self.params if p.default is _EMPTY)
        self.returns = len(parsed.returns)  # how many values the op returns
        self.signature = inspect.Signature([
            inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY if p.keyword_only
                              else inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default)
            for p in self.params])

    def bind(self, args: tuple, kwargs: dict) -> Args:
        """The call's arguments by name with defaults filled in; TypeError as Python would raise it."""
        if len(args) > len(self.positional):
            raise TypeError(f"{self.name}() takes {len(self.positional)} positional arguments but {len(args)} "
                            "were given")
        values = dict(self.defaults)
        values.update(zip(self.positional, args))
        for key, value in kwargs.items():
            if key not in values and key not in self.required:
                raise TypeError(f"{self.name}() got an unexpected keyword argument '{key}'")
            if key in self.positional[: len(args)]:
                raise TypeError(f"{self.name}() got multiple values for argument '{key}'")
            values[key] = value
        if len(values) != len(self.names):
            missing = [n for n in self.required if n not in values]
            raise TypeError(f"{self.name}() missing required argument(s): {', '.join(map(repr, missing))}")
        return Args(values)

    def rebind(self, args: tuple, kwargs: dict) -> Args:
        """bind, unchecked, for a call passing the same argument names as one `bind` accepted (eager only: the
        values are set at once, which torch.compile may not follow)."""
        a = Args.__new__(Args)
        values = a.__dict__
        values.update(self.defaults)
        values.update(zip(self.positional, args))
        values.update(kwargs)
        return a

    def call_args(self, a: Args) -> tuple[tuple, dict]:
        """(positional, keyword) arguments that call an implementation with the bound values."""
        return (tuple(getattr(a, n) for n in self.positional),
                {n: getattr(a, n) for n in self.names[len(self.positional):]})

    def validate(self, fn: Callable, extra: tuple[inspect.Parameter, ...] = (), *, where: str) -> None:
        """Raise SignatureError unless fn's signature is this schema's (plus `extra` keyword-only parameters)."""
        expected = [*self.signature.parameters.values(), *extra]
        try:
            actual = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError) as exc:
            raise SignatureError(f"{where}: cannot read the signature of {fn!r} ({exc})") from None
        for i, want in enumerate(expected):
            if i >= len(actual):
                raise SignatureError(f"{where}: parameter '{want.name}' is missing; the op's schema is {self.text}")
            got = actual[i]
            if got.name != want.name:
                raise SignatureError(f"{where}: parameter {i} is '{got.name}', the schema has '{want.name}'; "
                                     f"the op's schema is {self.text}")
            if _kind(got) != _kind(want):
                raise SignatureError(f"{where}: parameter '{got.name}' must be {_kind(want)}, got {_kind(got)}")
            if not _same_default(got.default, want.default):
                raise SignatureError(f"{where}: parameter '{got.name}' must default to "
                                     f"{_show(want.default)}, got {_show(got.default)}")
        if len(actual) > len(expected):
            raise SignatureError(f"{where}: parameter '{actual[len(expected)].name}' is not in the op's schema "
                                 f"({self.text}); tuning knobs belong outside the op's arguments")

    def describe(self) -> str:
        """The signature as a reader wants it: `(logits, target, *, grad_scale=None, ...)`."""
        return str(self.signature)


def _kind(p: inspect.Parameter) -> str:
    return "keyword-only" if p.kind == inspect.Parameter.KEYWORD_ONLY else "positional-or-keyword"


def _same_default(got, want) -> bool:
    if got is _EMPTY or want is _EMPTY:
        return got is want
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and tuple(got) == tuple(want)
    if isinstance(want, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and float(got) == float(want)
    return type(got) is type(want) and got == want


def _show(default) -> str:
    return "nothing (required)" if default is _EMPTY else repr(default)

