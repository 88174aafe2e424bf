"""A model's projections: `Kernel`, and a layer's sibling projections in one call.

`Kernel` is a projection whose kernel has the given shape. Its product goes through XLA
(`layers.dot`), the packed CPU kernel (`speclm.kernels.cpu_matmul`, parameters packed by
`llama.pack_for_cpu`) or a GGUF file's blocks kept as stored (`speclm.kernels.quantized`), by
which parameters it holds.

`sibling_products` applies several Kernels that read the same input, a layer's query, key and
value or its gate and up. Where all of them hold interleaved GGUF rows of one format (and no
bias), it multiplies them in one kernel call (`quantized.products`). The input is then split
into digits once, and the threads share out all the matrices' rows together. A decode step of
SmolLM2 makes 90 fewer calls. Each output is bitwise the one its own Kernel gives, so the
parameter tree, and any number it yields, stays the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from speclm.models import layers


class Kernel(nn.Module):
  """A projection whose kernel has the given shape; `spec` is its einsum. With `use_bias`
  a bias over the output dims is added (Qwen2's query/key/value)."""

  shape: tuple[int, ...]
  spec: str
  fan_in: int
  param_dtype: Any
  dtype: Any
  merge_input_dims: int = 1  # leading kernel dims multiplied as one (x flattened to match)
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    out = self._product(x)
    if self.use_bias:
      bias = self.param('bias', nn.initializers.zeros, self.shape[self.merge_input_dims:],
                        self.param_dtype)
      out = (out.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)
    return out

  def _product(self, x):
    init = nn.initializers.normal(stddev=1.0 / math.sqrt(self.fan_in))
    stored = stored_format(self)
    if stored is not None:
      return self._quantized_product(x, stored)
    if self.has_variable('params', 'packed') and kernel_serves(x, self.merge_input_dims):
      return self._packed_product(x)
    kernel = self.param('kernel', init, self.shape, self.param_dtype)
    if self.merge_input_dims > 1:
      # A plain 2-D product on contiguous reshapes (free): XLA then reads the kernel as stored
      # instead of transposing it on every call.
      kernel = kernel.reshape((-1,) + self.shape[self.merge_input_dims:])
      x = x.reshape(x.shape[:x.ndim - self.merge_input_dims] + (-1,))
    return layers.dot(self.spec, x, kernel, self.dtype)

  def _packed_product(self, x):
    """The same product through `cpu_matmul`: weights streamed once for any number of rows."""
    from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
    merge = self.merge_input_dims
    return cpu_matmul.packed_product(x, self.get_variable('params', 'packed'),
                                     self.shape[merge:], self.dtype, input_dims=merge)

  def _quantized_product(self, x, fmt: str):
    """The product with the kernel kept in GGUF's blocks (`speclm.kernels.quantized`): the
    stored rows are the kernel's output units, each over all its (merged) inputs."""
    from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
    merge = self.merge_input_dims
    lead = x.shape[:x.ndim - merge]
    flat = x.reshape(-1, math.prod(x.shape[x.ndim - merge:])).astype(jnp.float32)
    y = quantized.product(flat, self.get_variable('params', fmt), fmt)
    return y.reshape(lead + self.shape[merge:]).astype(self.dtype)


def sibling_products(module: nn.Module, x: jax.Array,
                     kernels: Sequence[Kernel]) -> list[jax.Array]:
  """Each of `kernels` (children of `module`, constructed in its compact method and not yet
  called, each reading x `[..., D]` as a whole) applied to x: in one `quantized.products`
  call where `shared_stored_format` finds one, else each called in turn."""
  params = module.variables.get('params', {})
  fmt = shared_stored_format(params, kernels)
  if fmt is None:
    return [kernel(x) for kernel in kernels]
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  outs = quantized.products(flat, [params[kernel.name][fmt] for kernel in kernels], fmt)
  return [y.reshape(x.shape[:-1] + tuple(kernel.shape[1:])).astype(kernel.dtype)
          for kernel, y in zip(kernels, outs)]


def shared_stored_format(params, kernels: Sequence[Kernel]) -> str | None:
  """The interleaved format whose rows every one of `kernels` holds in `params` (its parent's
  parameters) and nothing else: no bias, one input dim, the same row bytes. None otherwise
  (float kernels, mixed formats as in Q4_K_M files, Qwen2's biases, the float route)."""
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  if len(kernels) < 2 or not quantized.interleaving():
    return None
  formats, row_bytes = set(), set()
  for kernel in kernels:
    held = dict(params.get(kernel.name, {}))
    fmt = quantized.format_of(held)
    if (fmt is None or len(held) != 1 or kernel.use_bias or kernel.merge_input_dims != 1
        or not quantized.interleaved(fmt)):
      return None
    formats.add(fmt)
    row_bytes.add(held[fmt].shape[1])
  return formats.pop() if len(formats) == 1 and len(row_bytes) == 1 else None


def on_cpu_kernels(attention_params) -> bool:
  """Whether an `Attention`'s products (given its parameters) go through the CPU kernels
  (`pack_for_cpu`, GGUF blocks): its decode steps then attend through
  `speclm.kernels.cache_attention` too, and prompts `speclm.kernels.prompt_attention`."""
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  query = attention_params.get('query', {})
  return 'packed' in query or quantized.format_of(dict(query)) is not None


def stored_format(module: nn.Module) -> str | None:
  """The quantized format whose stored rows `module` holds instead of a float parameter."""
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  for fmt in quantized.STORED_FORMATS:
    if module.has_variable('params', fmt):
      return fmt
  return None


def kernel_serves(x, input_dims: int) -> bool:
  """Whether the packed kernel takes this product: few rows (decode steps, verification);
  long prompts go to XLA's product of the plain kernel kept beside the packed copy."""
  from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
  return cpu_matmul.serves(math.prod(x.shape[:x.ndim - input_dims]))
