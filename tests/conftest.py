"""Test setup: JAX on the host CPU, float32."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
