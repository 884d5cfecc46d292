"""Helpers shared by the tests (importable as `helpers`: pyproject adds tests/ to the path)."""

import numpy as np


def snr_db(reference, output) -> float:
    """Signal-to-noise ratio 20 log10(|ref| / |ref - out|) in float64; inf when equal."""
    reference = np.asarray(reference, np.float64)
    error = np.linalg.norm(reference - np.asarray(output, np.float64))
    return float("inf") if error == 0 else float(20 * np.log10(np.linalg.norm(reference) / error))
