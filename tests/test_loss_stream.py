"""The loss stream of the fused-linear chunk loop (liger_dispatch/loss_stream.py): inactive off CUDA or unless
LIGER_CHUNK_OVERLAP=1; on the GPU the overlapped loop gives the loop's results, and captures into a CUDA graph."""

import pytest
import torch

from liger_dispatch import dispatch, loss_stream
from liger_dispatch.fused_linear import run_chunks
from liger_dispatch.loss_stream import LossStream

from kernel_checks import assert_rel_close


def test_inactive_off_cuda_even_when_asked(monkeypatch):
    monkeypatch.setenv("LIGER_CHUNK_OVERLAP", "1")
    stream = LossStream(torch.device("cpu"))
    assert list(stream.parts(128, 1000)) == [(128, 1000)]
    assert stream.run(lambda a, b: a + b, 1, 2) == (3, None)
    stream.wait(None)


def test_parts_are_row_aligned_halves():
    assert loss_stream.split(0, 2048) == [(0, 1024), (1024, 2048)]
    assert loss_stream.split(2048, 3048) == [(2048, 2560), (2560, 3048)]
    assert loss_stream.split(0, 100) == [(0, 100)]  # too few rows to split


def _head(n=1536, hidden=256, vocab=5000, dtype=torch.bfloat16, device="cuda"):
    x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5).to(dtype).requires_grad_()
    return x, w


def _other_inputs(op, x, w):
    """The arguments after (x, w) of a call of `op`: labels with ignored rows; a teacher head or target."""
    labels = torch.randint(0, w.shape[0], (x.shape[0],), device=x.device)
    labels[::7] = -100
    if op == "flce":
        return (labels,)
    if op == "fused_linear_jsd":
        return (*(t.detach() for t in _head(*x.shape, w.shape[0], x.dtype, x.device)), labels)
    return torch.softmax(torch.randn(x.shape[0], w.shape[0], device=x.device), -1), labels


def _loss_and_grads(fn, x, w, *args, **kwargs):
    x.grad = w.grad = None
    loss = fn(x, w, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.filterwarnings("error")  # a GEMM's out= buffer too small is resized with a warning, not an error
@pytest.mark.parametrize("op", ["flce", "fused_linear_jsd", "fused_linear_kl_div"])
def test_chunks_cut_into_parts_give_the_loop_results(op, monkeypatch):
    """run_chunks' part arithmetic, inline on the CPU with the reference kernels: a chunk of 128 rows cut in two
    parts of 64, then a last chunk of 100 rows left whole, larger than the parts before it (jsd's teacher buffer,
    sized by the first call, must grow)."""
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "128")
    x, w = _head(228, 16, 40, torch.float32, "cpu")
    other = _other_inputs(op, x, w)
    handle = dispatch.op(op, backend="reference")
    plain = _loss_and_grads(handle, x, w, *other)
    monkeypatch.setattr(LossStream, "parts", lambda self, start, end: loss_stream.split(start, end))
    cut = _loss_and_grads(handle, x, w, *other)
    for name, got, want in zip(("loss", "dx", "dw"), cut, plain):
        assert_rel_close(name, got, want, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["flce", "fused_linear_jsd", "fused_linear_kl_div"])
def test_overlap_gives_the_loop_results(op, monkeypatch):
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "512")  # three chunks of two parts
    x, w = _head()
    extra = _other_inputs(op, x, w)
    handle = dispatch.op(op, backend="triton")
    plain = _loss_and_grads(handle, x, w, *extra)
    monkeypatch.setenv("LIGER_CHUNK_OVERLAP", "1")
    overlapped = _loss_and_grads(handle, x, w, *extra)
    assert loss_stream._streams, "the loss stream was not used"
    torch.testing.assert_close(overlapped[0], plain[0], rtol=0, atol=0)  # same rows, same kernels, same sum
    for name, got, want in zip(("dx", "dw"), overlapped[1:], plain[1:]):
        assert_rel_close(name, got, want, 1e-3)  # dX by parts: another GEMM split, the same sums


def _captured_loop(x, w, labels, scale):
    from liger_dispatch.backends.triton.ce import ce_loss_and_grad

    def chunk_loss(logits, start, end, chunk_scale):
        return ce_loss_and_grad(logits, labels[start:end], grad_scale=chunk_scale)

    return run_chunks(x, w, None, scale, chunk_loss, want_dx=True, want_dw=True, want_db=False)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_made_before", [True, False])
def test_overlap_captures_into_a_cuda_graph(stream_made_before, monkeypatch):
    """Captured with the loss stream (made by an eager call first) or without it (no stream is made during capture);
    the replay gives the eager result."""
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "512")
    monkeypatch.setenv("LIGER_CHUNK_OVERLAP", "1")
    if not stream_made_before:
        monkeypatch.setattr(loss_stream, "_streams", {})
    x, w = (t.detach() for t in _head())
    labels = torch.randint(0, w.shape[0], (x.shape[0],), device="cuda")
    scale = torch.tensor(1.0 / x.shape[0], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the default stream, as torch.cuda.graph asks
        eager = _captured_loop(x, w, labels, scale) if stream_made_before else None
        if not stream_made_before:
            monkeypatch.setenv("LIGER_CHUNK_OVERLAP", "0")
            eager = _captured_loop(x, w, labels, scale)
            monkeypatch.setenv("LIGER_CHUNK_OVERLAP", "1")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _captured_loop(x, w, labels, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert bool(loss_stream._streams) == stream_made_before
    for name, got, want in zip(("loss rows", "dx", "dw"), captured, eager):
        assert_rel_close(name, got, want, 1e-3)
