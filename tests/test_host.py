"""The host layer the backends share (backends/_host.py), and Helion's interpreter fixes staying local to its calls."""

import pytest
import torch

from liger_dispatch.backends import _host


def test_bounded_cache_makes_once_and_starts_over_when_full():
    cache = _host.BoundedCache("test", 3)
    made = []

    def make(key):
        return lambda: made.append(key) or key * 10

    assert [cache.get(k, make(k)) for k in (1, 2, 1, 2)] == [10, 20, 10, 20]
    assert made == [1, 2]
    for k in (3, 4, 5):
        cache.get(k, make(k))
    assert len(cache) <= 3
    cache.drop(lambda key: key != 5)
    assert 5 not in [v // 10 for v in cache.values()]


def test_compile_cache_is_bounded_and_keeps_the_function():
    calls = []

    @_host.compile_cache(limit=2)
    def compiled(key):
        calls.append(key)
        return object()

    first = compiled("a")
    assert compiled("a") is first and calls == ["a"]
    compiled("b"), compiled("c")
    assert compiled("a") is not first  # dropped: least recently used
    assert compiled.__wrapped__ is not None  # tests bypass the cache with it


def test_sm_count_on_the_interpreters_cpu():
    assert _host.sm_count(torch.device("cpu")) == _host.INTERPRETER_SMS


def test_scratch_views_and_addresses_agree_and_are_aligned():
    scratch = _host.Scratch({"gz": (torch.bfloat16, (5, 24)), "coef": (torch.float32, (5,)),
                             "hist": (torch.float32, (5, 2, 4, 4))})
    memory, views = scratch.allocate(torch.device("cpu"), addresses=False)
    assert [tuple(v.shape) for v in views.values()] == [(5, 24), (5,), (5, 2, 4, 4)]
    assert [v.dtype for v in views.values()] == [torch.bfloat16, torch.float32, torch.float32]
    offsets = [v.data_ptr() - memory.data_ptr() for v in views.values()]
    memory2, addresses = scratch.allocate(torch.device("cpu"), addresses=True)
    assert [a - memory2.data_ptr() for a in addresses.values()] == offsets
    assert all(o % _host.Scratch.ALIGN == 0 for o in offsets)
    for v in views.values():  # the buffers do not overlap: each keeps what is written into it
        v.fill_(1.0)
    ends = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views.values())
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))
    assert memory.numel() == scratch.nbytes


def test_operand_normalization_copies_only_when_it_must():
    x = torch.randn(4, 6)
    assert _host.unit_column_stride(x) is x
    assert _host.unit_column_stride(torch.randn(8, 6)[::2]).stride() == (12, 1)  # a row stride is fine
    assert _host.unit_column_stride(x.t()).stride(1) == 1
    a, b = _host.contiguous(x, x.t())
    assert a is x and b.is_contiguous() and torch.equal(b, x.t())


def test_importing_helion_does_not_patch_triton():
    """Helion's fixes to Triton's interpreter are applied while a Helion kernel runs, and only then."""
    pytest.importorskip("helion")
    from liger_dispatch.backends.helion import _support, ce

    if not _support.TRITON_INTERPRETER:
        pytest.skip("the fixes are for Triton's interpreter")
    patches = _support._interpreter_patches()

    def patched():
        return [getattr(owner, name) is value for owner, name, value in patches]

    assert not any(patched())
    with _support.interpreter_fixes():
        seen = patched()
    assert all(seen) and not any(patched())
    logits, target = torch.randn(3, 20), torch.randint(0, 20, (3,))
    ce.ce_loss_and_grad(logits, target)  # runs in the interpreter with the fixes, then restores
    assert not any(patched())
