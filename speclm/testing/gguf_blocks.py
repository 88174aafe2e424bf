"""Random GGUF blocks for tests of `speclm.kernels.quantized`: any quant bytes, with finite
float16 scales, so that every product is a finite number to compare."""

from __future__ import annotations

import numpy as np

from speclm.kernels import quantized

# Byte offsets of each block's float16 scales (d, and m or dmin where there is one).
SCALE_OFFSETS = {'Q8_0': (0,), 'Q4_0': (0,), 'Q4_1': (0, 2), 'Q4_K': (0, 2), 'Q5_K': (0, 2),
                 'Q6_K': (208,)}


def random_rows(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
  """Random blocks of `fmt` for an `[n, k]` matrix (uint8 `[n, row_bytes]`) whose scales are
  finite float16 values of about 0.01 (the other bytes are any)."""
  rng = np.random.default_rng(seed)
  weights, size = quantized.FORMATS[fmt]
  raw = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
  for offset in SCALE_OFFSETS[fmt]:
    scales = (rng.standard_normal((n, k // weights)) * 0.01).astype(np.float16)
    raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(n, k // weights, 2)
  return raw.reshape(n, -1)
