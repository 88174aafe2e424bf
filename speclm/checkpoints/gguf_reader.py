"""The `gguf` package's reader, with metadata arrays read in one pass instead of one value at a
time.

`gguf.GGUFReader` parses a metadata array element by element, making a numpy view (and, for a
string, two) of every element. A tokenizer of 49k tokens and 49k merges is some 200k views:
about 2.1 s on 2 cores, paid by every process that opens SmolLM2's file before it loads a
single weight. `FastGGUFReader` finds the same elements with one scan over the bytes:

* an array of numbers becomes one view of all of them;
* an array of strings keeps one view per string (its bytes), found by reading the length
  prefixes from the buffer directly.

Each field's `contents()` returns what the package's reader returns (the checks in
`tests/test_gguf.py` compare every field of a file). Files written in the other byte order, and
nested arrays, go through the package's own code.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np

_LENGTH = struct.Struct('<Q')


@functools.cache
def fast_reader_class():
  """`gguf.GGUFReader`'s subclass (made on first use: the `gguf` package is an optional
  extra, imported only where a GGUF file is read)."""
  import gguf  # pylint: disable=import-outside-toplevel
  value_type = gguf.GGUFValueType

  class FastGGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` with arrays of strings and of numbers parsed in one pass."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any],
                                                                        list[int], list[Any]]:
      if value_type(raw_type) != value_type.ARRAY or self.byte_order != 'I':
        return super()._get_field_parts(orig_offs, raw_type)
      raw_item_type = self._get(orig_offs, np.uint32)
      count = self._get(orig_offs + 4, np.uint64)
      item_type = value_type(int(raw_item_type[0]))
      start = orig_offs + 12
      parts: list[Any] = [raw_item_type, count]
      # The package lists an element type only where the array has an element.
      types = [value_type.ARRAY, item_type] if count[0] else [value_type.ARRAY]
      if item_type == value_type.STRING:
        plain = self.data.view(np.ndarray)  # slices of a plain array: 15x cheaper than a memmap's
        buffer = memoryview(plain)
        offset = start
        for _ in range(int(count[0])):
          (length,) = _LENGTH.unpack_from(buffer, offset)
          parts.append(plain[offset + 8:offset + 8 + length])
          offset += 8 + length
        return offset - orig_offs, parts, list(range(2, len(parts))), types
      numpy_type = self.gguf_scalar_to_np.get(item_type)
      if numpy_type is None:  # an array of arrays
        return super()._get_field_parts(orig_offs, raw_type)
      values = self._get(start, numpy_type, int(count[0]))
      # One part holding every value: `contents()` flattens the parts its data indexes.
      parts.append(values)
      return 12 + int(values.nbytes), parts, [2] if len(values) else [], types

  return FastGGUFReader
