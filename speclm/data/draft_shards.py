"""The training shards of the SmolLM2 drafts: what each holds, which are held out, and the
model card's account of them.

`scripts/train_smollm2_draft.py --stage=generate`, `scripts/train_sharegpt_draft.py` and
`scripts/train_smollm2_eagle.py` share one work-dir format: `gen_<source>_<n>.npz` (tokens,
lengths, a loss mask or prompt lengths) beside `label_*.npz` (the target's soft labels) and
`feat-*.npz` (its features). The source is in the name:

  gen_sharegpt_*   pieces of ShareGPT V3 conversations (the loss on the assistant's turns)
  gen_own_*        SmolLM2's own replies to their user turns (gen_own_t<N>_*: the N-th turns,
                   after the earlier ones; the first turns' have no t<N>)
  gen_<other>_*    SmolLM2's replies to built-in, self-written or grounded prompts

A name containing "heldout" (`gen_sharegpt_zheldout.npz`) is held out: never trained on.
`generation_seconds.txt` beside them totals the seconds spent generating them (model cards).

Feature files are the largest (about 3.5 KB a position for EAGLE-3's three layers): training
reads them memory-mapped (`load_array`), so that millions of positions need not fit in memory.
"""

from __future__ import annotations

import os
import struct
import zipfile

import numpy as np

SOURCES = ('sharegpt', 'own_replies', 'generated')


def source(path: str) -> str:
  """Which of `SOURCES` the shard at `path` holds."""
  name = os.path.basename(path)
  if name.startswith('gen_sharegpt_'):
    return 'sharegpt'
  if name.startswith('gen_own_'):
    return 'own_replies'
  return 'generated'


def is_heldout(path: str) -> bool:
  """Whether the shard at `path` is held out (never trained on): "heldout" in its name."""
  return 'heldout' in os.path.basename(path)


def count_sources(shards: list[str]) -> dict[str, dict[str, int]]:
  """Sequences and reply tokens (those the loss covers) per source over `shards`."""
  sources: dict[str, dict[str, int]] = {}
  for shard in shards:
    with np.load(shard) as data:
      lengths = data['lengths']
      replies = (data['loss_mask'].sum() if 'loss_mask' in data else
                 (lengths - data['prompt_lengths']).sum())
    counts = sources.setdefault(source(shard), dict(sequences=0, reply_tokens=0))
    counts['sequences'] += len(lengths)
    counts['reply_tokens'] += int(replies)
  return sources


def describe(sources: dict[str, dict[str, int]], own_replies_repeat: int = 1) -> str:
  """The model card's data phrase for `count_sources`'s result."""
  described = {
      'sharegpt': lambda n, r: f'{n:,} pieces of ShareGPT V3 conversations ({r:,} reply tokens;'
                               ' `scripts/train_sharegpt_draft.py`)',
      'own_replies': lambda n, r: f"SmolLM2's own replies to {n:,} of their user turns ({r:,}"
                                  f' tokens, each seen {own_replies_repeat}x per epoch)',
      'generated': lambda n, r: f"{n:,} prompts with SmolLM2's replies ({r:,} tokens;"
                                ' `scripts/train_smollm2_draft.py --stage=generate`: built-in'
                                ' training prompts, and where asked requests SmolLM2 wrote'
                                ' itself and requests on passages)'}
  return '; '.join(described[kind](c['sequences'], c['reply_tokens'])
                   for kind, c in sources.items())


def _seconds_file(work_dir: str) -> str:
  return os.path.join(work_dir, 'generation_seconds.txt')


def add_generation_seconds(work_dir: str, seconds: float) -> None:
  """Adds `seconds` to the work dir's generation total (resumed stages add up)."""
  total = generation_seconds(work_dir, 0.0)
  with open(_seconds_file(work_dir), 'w', encoding='utf-8') as f:
    f.write(f'{total + seconds:.1f}')


def generation_seconds(work_dir: str, default: float = float('nan')) -> float:
  """The work dir's generation total, or `default` where nothing was recorded."""
  path = _seconds_file(work_dir)
  if not os.path.exists(path):
    return default
  with open(path, encoding='utf-8') as f:
    return float(f.read())


def feature_file(shard: str, layers: tuple[int, ...] | None) -> str:
  """Where the target's features of `layers` (None: its final hidden states) for the data
  shard gen_*.npz go: `features` `[N, T, F]` (bfloat16 bits as uint16), `seconds`, `layers`."""
  tag = '' if layers is None else '-l' + '-'.join(map(str, layers))
  return shard.replace('gen_', f'feat{tag}_')


def label_file(shard: str) -> str:
  """Where the target's soft labels for the data shard gen_*.npz go: `probs` `[N, T, k]`
  (float16, its top k of the temperature-1 distribution at each position) and their `ids`."""
  return shard.replace('gen_', 'label_')


def save_npz(path: str, **arrays) -> None:
  """np.savez (uncompressed, so `load_array` can map it) to `path`, whole or not at all: an
  interrupted run leaves no partial file."""
  tmp = path + '.tmp.npz'
  np.savez(tmp, **arrays)
  os.replace(tmp, path)


def load_array(path: str, name: str) -> np.ndarray:
  """The array `name` of the .npz file at `path`, memory-mapped read-only where it is stored
  uncompressed (as `save_npz` and np.savez write it): its pages are read when used and can be
  dropped again, so no more of it stays in memory than the page cache holds. A compressed
  member is read whole."""
  with zipfile.ZipFile(path) as archive:
    info = archive.getinfo(name + '.npy')
    if info.compress_type != zipfile.ZIP_STORED:
      with archive.open(info) as member:
        return np.lib.format.read_array(member)
  with open(path, 'rb') as f:
    f.seek(info.header_offset)
    local = f.read(30)  # the member's local header; its name and extra field follow
    if local[:4] != b'PK\x03\x04':
      raise ValueError(f'{path}: no zip member header at {info.header_offset}')
    name_length, extra_length = struct.unpack('<HH', local[26:30])
    f.seek(info.header_offset + 30 + name_length + extra_length)
    version = np.lib.format.read_magic(f)
    shape, fortran_order, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0(f))
    offset = f.tell()
  if dtype.hasobject:
    raise ValueError(f'{path}: {name} holds Python objects; it cannot be mapped.')
  return np.memmap(path, dtype=dtype, mode='r', offset=offset, shape=shape,
                   order='F' if fortran_order else 'C')
