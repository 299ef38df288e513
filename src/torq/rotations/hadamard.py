"""Real Hadamard matrices of the orders that LLM widths need, not only powers of two.

A Hadamard matrix ``H`` of order ``n`` has entries ±1 and ``H Hᵀ = n I``; ``H/√n`` is an
orthogonal matrix whose entries all have magnitude ``1/√n``. That is exactly the mixing
matrix the closed-form inter-block rotation needs (method-notes §2), and it is the rotation
of the Hadamard/QuaRot baselines.

Constructions: Sylvester (``2^k``), Paley I (``q + 1`` for a prime ``q ≡ 3 mod 4``),
Paley II (``2(q + 1)`` for a prime ``q ≡ 1 mod 4``) and Kronecker products of these. They
cover, e.g., 12, 20, 24, 28, 44, 48, 60, 152, 576 and 896, but no order that is not 1, 2
or a multiple of 4 (no real Hadamard matrix exists there, e.g. 18).
"""

from __future__ import annotations

from functools import cache

import torch


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def _sylvester(k: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(k):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j − i), with χ the quadratic character of GF(q), q prime."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor(
        [0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64
    )
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1, for a prime q ≡ 3 (mod 4)."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(n, dtype=torch.float64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1), for a prime q ≡ 1 (mod 4)."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:] = 1.0
    c[1:, 0] = 1.0
    c[1:, 1:] = _jacobsthal(q)
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    out = torch.kron(c, b)
    zero = c == 0
    out[torch.kron(zero, torch.ones(2, 2, dtype=torch.bool))] = a.repeat(n, n)[
        torch.kron(zero, torch.ones(2, 2, dtype=torch.bool))
    ]
    return out


@cache
def _base_orders() -> dict[int, str]:
    """Orders up to 1024 with a direct (non-Sylvester-doubling) construction."""
    orders: dict[int, str] = {1: "sylvester", 2: "sylvester"}
    for q in range(3, 1024):
        if _is_prime(q) and q % 4 == 3:
            orders.setdefault(q + 1, "paley1")
        if _is_prime(q) and q % 4 == 1 and 2 * (q + 1) <= 2048:
            orders.setdefault(2 * (q + 1), "paley2")
    return orders


def _leaves(n: int) -> list[int] | None:
    """The orders whose Kronecker product (in this order) is the order-``n`` construction:
    one power of two, Paley order or their product each."""
    if n >= 1 and (n & (n - 1) == 0 or n in _base_orders()):
        return [n]
    for a in range(2, int(n**0.5) + 1):
        if n % a == 0:
            la, lb = _leaves(a), _leaves(n // a)
            if la is not None and lb is not None:
                return la + lb
    return None


def _leaf(n: int) -> torch.Tensor:
    if n & (n - 1) == 0:
        return _sylvester(n.bit_length() - 1)
    return _paley1(n - 1) if _base_orders()[n] == "paley1" else _paley2(n // 2 - 1)


def _construct(n: int) -> torch.Tensor | None:
    leaves = _leaves(n) if n >= 1 else None
    if leaves is None:
        return None
    h = _leaf(leaves[0])
    for m in leaves[1:]:
        h = torch.kron(h, _leaf(m))
    return h


@cache
def _cached(n: int) -> torch.Tensor | None:
    h = _construct(n)
    if h is not None and not torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)):
        raise AssertionError(f"Hadamard construction of order {n} is wrong")
    return h


def has_hadamard(n: int) -> bool:
    """Whether :func:`hadamard_matrix` can build an order-``n`` Hadamard matrix."""
    return n >= 1 and _cached(n) is not None


def hadamard_factors(n: int, normalized: bool = True) -> list[torch.Tensor]:
    """Square matrices ``F₁, …, F_m`` with ``F₁ ⊗ … ⊗ F_m`` = :func:`hadamard_matrix` ``(n)``
    exactly (normalized when asked), grouped into at most two factors of balanced order.

    Multiplying by a Kronecker product factor by factor costs ``n·Σ|F_i|`` per vector
    instead of ``n²`` (e.g. 1536 = 32·48: 80 instead of 1536 multiply-adds per element),
    which is what makes a full-width online Hadamard cheap (QuaRot's, ``hadfull``).
    """
    leaves = _leaves(n) if n >= 1 else None
    if leaves is None:
        raise ValueError(f"no Hadamard matrix construction for order {n}")
    # Split the leaf list where the two products are closest to √n (kron is associative).
    best, split = None, len(leaves)
    for i in range(1, len(leaves) + 1):
        left = 1
        for m in leaves[:i]:
            left *= m
        cost = left + n // left if i < len(leaves) else n
        if best is None or cost < best:
            best, split = cost, i
    factors = []
    for group in (leaves[:split], leaves[split:]):
        if not group:
            continue
        h = _leaf(group[0])
        for m in group[1:]:
            h = torch.kron(h, _leaf(m))
        order = h.shape[0]
        factors.append(h / order**0.5 if normalized else h)
    return factors


def hadamard_matrix(
    n: int, normalized: bool = True, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """An order-``n`` Hadamard matrix (``/√n`` when ``normalized``, then orthogonal).

    Raises ``ValueError`` for orders this module cannot construct (see module docstring).
    """
    h = _cached(n) if n >= 1 else None
    if h is None:
        raise ValueError(f"no Hadamard matrix construction for order {n}")
    return (h / n**0.5 if normalized else h).to(dtype)
