"""How figures read in tables and reports, the same everywhere."""

from __future__ import annotations


def tflops_text(x: float) -> str:
    """TFLOP/s with the digits that matter: a GPU's 387.4, a CPU rank's 0.0352 (not 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"
