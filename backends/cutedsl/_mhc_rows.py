"""The per-row mHC coefficient math of the CuTeDSL kernels, on Python lists of fp32 scalars.

Traced inline into the kernels (one thread per row, every loop unrolled at trace time). Plain Python
arithmetic on the DSL's scalars, so the tests also run it on Python floats.
"""

import cutlass.cute as cute

from ._row import LOG2E


def dot(a, b):
    return sum((x * y for x, y in zip(a[1:], b[1:])), a[0] * b[0])


def sigmoid(u):
    return 1.0 / (1.0 + cute.math.exp2(-u * LOG2E, fastmath=True))


def _softmax_rows(L):
    out = []
    for row in L:
        m = row[0]
        for v in row[1:]:
            m = cute.arch.fmax(m, v)
        e = [cute.math.exp2((v - m) * LOG2E, fastmath=True) for v in row]
        inv = 1.0 / sum(e[1:], e[0])
        out.append([v * inv for v in e])
    return out


def _normalize_columns(A, eps):
    """A / (column sums + eps), and the denominators."""
    den = [sum((row[c] for row in A[1:]), A[0][c]) + eps for c in range(len(A[0]))]
    inv = [1.0 / d for d in den]
    return [[v * inv[c] for c, v in enumerate(row)] for row in A], den


def _normalize_rows(A, eps):
    den = [sum(row[1:], row[0]) + eps for row in A]
    return [[v * (1.0 / d) for v in row] for row, d in zip(A, den)], den


def sinkhorn(L, tmax, eps):
    """(softmax S, result P, row denominators of rounds 1.., column denominators of rounds 0..)."""
    S = _softmax_rows(L)
    P, col_den = _normalize_columns([[s + eps for s in row] for row in S], eps)
    row_dens, col_dens = [], [col_den]
    for _ in range(1, tmax):
        R, row_den = _normalize_rows(P, eps)
        P, col_den = _normalize_columns(R, eps)
        row_dens.append(row_den)
        col_dens.append(col_den)
    return S, P, row_dens, col_dens


def _column_step_backward(G, P, den):
    """Through P = A / (colsum(A) + eps): dA[r][c] = (G[r][c] - sum_r' G[r'][c] P[r'][c]) / den[c]."""
    hc = len(G)
    dot = [sum((G[r][c] * P[r][c] for r in range(1, hc)), G[0][c] * P[0][c]) for c in range(hc)]
    inv = [1.0 / d for d in den]
    return [[(G[r][c] - dot[c]) * inv[c] for c in range(hc)] for r in range(hc)]


def _row_step_backward(G, P, den):
    hc = len(G)
    dot = [sum((G[r][c] * P[r][c] for c in range(1, hc)), G[r][0] * P[r][0]) for r in range(hc)]
    return [[(G[r][c] - dot[r]) * (1.0 / den[r]) for c in range(hc)] for r in range(hc)]


def sinkhorn_backward(S, P, row_dens, col_dens, G):
    """dL/dlogits from dL/dP. Each round's input is rebuilt from its output times its denominators."""
    for t in range(len(row_dens), 0, -1):
        G = _column_step_backward(G, P, col_dens[t])
        P = [[v * col_dens[t][c] for c, v in enumerate(row)] for row in P]
        G = _row_step_backward(G, P, row_dens[t - 1])
        P = [[v * d for v in row] for row, d in zip(P, row_dens[t - 1])]
    G = _column_step_backward(G, P, col_dens[0])
    # through S = softmax(L) (the + eps has no derivative): dL = S * (G - sum_c' G S)
    hc = len(G)
    dot = [sum((G[r][c] * S[r][c] for c in range(1, hc)), G[r][0] * S[r][0]) for r in range(hc)]
    return [[S[r][c] * (G[r][c] - dot[r]) for c in range(hc)] for r in range(hc)]
