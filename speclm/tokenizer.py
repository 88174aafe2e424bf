"""Text in, text out: tokenizers for decoder-only models, and their chat templates.

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust library) with what the
decode loops need: token ids for a batch of prompts (right-padded `[B, P]` plus lengths), the
end-of-sequence id, and decoding of `DecodeResult`s back to text. It is built either

* from a Hugging Face directory (`Tokenizer.from_pretrained_dir`: `tokenizer.json`, optionally
  `tokenizer_config.json`), or
* from a byte-level BPE vocabulary and merges (`byte_level_bpe`), as a GGUF file's metadata
  holds them: `speclm.checkpoints.gguf.load_tokenizer(path)` reads those (this module reads
  no checkpoint files).

Chat templates are Jinja programs stored with the model; `render_chat` runs them in a
sandboxed `jinja2` environment with the settings transformers uses (trim_blocks,
lstrip_blocks), so the prompt text is the one the model was tuned on. A template is a program
from the checkpoint, so its rendering is bounded: at most `MAX_RENDERED_CHARS` characters (of
output, and of any string it builds) and `MAX_RENDER_SECONDS` seconds; past either, or on
anything the sandbox blocks, `ChatTemplateError` says which template and why.

A tokenizer file that cannot be read (truncated JSON, a corrupt `tokenizer.json`) is a
`TokenizerFileError` naming it; `speclm.checkpoints.llm` passes it on as a `CheckpointError`.

    tok = gguf.load_tokenizer(path)        # speclm.checkpoints.gguf
    prompts, lengths = tok.batch([tok.encode_chat('What is 2 + 2?'), tok.encode('Once upon')])
    result = speclm.autoregressive_decode(model, prompts, lengths, eos_id=tok.eos_id)
    print(tok.decode_result(result))
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

_SETUP_HINT = 'Install it with `pip install tokenizers jinja2` (speclm extra: `speclm[hf]`).'

# Bounds on one chat template rendering (a template is code shipped with a checkpoint).
MAX_RENDERED_CHARS = 1_000_000
MAX_RENDER_SECONDS = 5.0


class TokenizerFileError(ValueError):
  """A tokenizer file that exists but cannot be read; the message (one line) names it.

  Attributes:
    path: the file.
    key: the entry at fault, when one is (None for the whole file).
  """

  def __init__(self, message: str, *, path: str, key: str | None = None):
    super().__init__(' '.join(message.split()))
    self.path = path
    self.key = key


class ChatTemplateError(ValueError):
  """A chat template that failed, ran too long, built too much text or was stopped by the
  sandbox; the message (one line) names the template's file when known."""

# GPT-2's split of text into words, numbers, punctuation runs and whitespace.
_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
# Llama 3's split (numbers in groups of up to three digits, case-insensitive contractions).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen2, 2.5 and 3): Llama 3's with every digit alone.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r'\p{N}{1,3}', r'\p{N}')
# Pre-tokenization names (llama.cpp's, GGUF's `tokenizer.ggml.pre`), grouped as llama.cpp does.
_DIGIT_SPLIT_PRE = ('smollm', 'starcoder', 'refact', 'command-r', 'codeshell', 'exaone',
                    'minerva')
_GPT2_PRE = ('gpt2', 'default', 'mpt', 'olmo', 'jais', 'gpt-2')
_LLAMA3_PRE = ('llama3', 'llama-bpe', 'llama-v3', 'smaug-bpe', 'dbrx')
_QWEN2_PRE = ('qwen2', 'stablelm2', 'hunyuan')


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'Tokenization needs the `tokenizers` package. {_SETUP_HINT}') from e
  return tokenizers


class Tokenizer:
  """A text tokenizer with special ids and an optional chat template.

  Attributes:
    backend: the `tokenizers.Tokenizer` doing the work.
    bos_id, eos_id, pad_id: special ids (None when the model has none). `eos_id` is the token
      that ends a reply; pass it to the decode loops.
    add_bos: whether `encode` prepends `bos_id` by default (GGUF `add_bos_token`).
    chat_template: the Jinja chat template, or None.
    chat_template_source: the file the template came from (named in its errors), or None.
    space_prefix: whether `encode` puts a space before the text (SentencePiece's dummy
      prefix, on the whole text: before special tokens too).
    extra_end_ids: the model's other tokens that end a reply (a chat model's end of turn,
      from Hugging Face's generation_config.json or GGUF's eot/eom ids). `end_ids` is all of
      them with `eos_id` first; pass it to the decode loops as `eos_id`.
  """

  def __init__(self, backend, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int | None = None, add_bos: bool = False,
               chat_template: str | None = None, space_prefix: bool = False,
               end_ids: Iterable[int] = (), chat_template_source: str | None = None):
    self.backend = backend
    self.chat_template_source = chat_template_source
    self.space_prefix = space_prefix
    self.extra_end_ids = tuple(int(i) for i in end_ids)
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.pad_id = pad_id
    self.add_bos = add_bos
    self.chat_template = chat_template

  @property
  def end_ids(self) -> tuple[int, ...]:
    """`eos_id` (if any), then the checkpoint's other end tokens, without repeats."""
    first = () if self.eos_id is None else (int(self.eos_id),)
    return tuple(dict.fromkeys(first + self.extra_end_ids))

  def __repr__(self) -> str:
    return (f'Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id},'
            f' chat_template={"yes" if self.chat_template else "no"})')

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(int(token_id))

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  # --- text <-> ids -----------------------------------------------------------------------------

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; special-token strings such as `<|im_start|>` become their ids."""
    if self.space_prefix:
      text = ' ' + text
    ids = self.backend.encode(text, add_special_tokens=True).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      if not ids or ids[0] != self.bos_id:
        ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True,
             stop_at_eos: bool = True) -> str:
    """Text of `ids`, cut at the first end token (`end_ids`) when `stop_at_eos`."""
    ids = [int(i) for i in ids]
    if stop_at_eos:
      ends = [k for k, i in enumerate(ids) if i in self.end_ids]
      ids = ids[:ends[0]] if ends else ids
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  # --- chat -------------------------------------------------------------------------------------

  def render_chat(self, messages: str | Sequence[Mapping[str, str]], *,
                  add_generation_prompt: bool = True, **extra: Any) -> str:
    """The prompt text for a conversation, rendered with the model's chat template.

    Args:
      messages: a list of {'role': 'system'|'user'|'assistant', 'content': str}, or one
        string (a single user message).
      add_generation_prompt: end with the header that starts the assistant's reply.
      **extra: further template variables.
    """
    if isinstance(messages, str):
      messages = [{'role': 'user', 'content': messages}]
    if not self.chat_template:
      raise ValueError('This tokenizer has no chat template; encode plain text with `encode`.')
    return _render(self.chat_template, self.chat_template_source, messages=list(messages),
                   add_generation_prompt=add_generation_prompt,
                   bos_token=self._token_text(self.bos_id), eos_token=self._token_text(self.eos_id),
                   **extra)

  def encode_chat(self, messages: str | Sequence[Mapping[str, str]], **kwargs: Any) -> list[int]:
    """Token ids of `render_chat(messages, …)` (no extra BOS: templates write their own)."""
    return self.encode(self.render_chat(messages, **kwargs), add_bos=False)

  def _token_text(self, token_id: int | None) -> str:
    return '' if token_id is None else (self.backend.id_to_token(token_id) or '')

  # --- batches ----------------------------------------------------------------------------------

  def batch(self, prompts: Sequence[str | Sequence[int]], *,
            pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int32 `[B, P]` prompts and their `[B]` lengths, as the decode loops take.

    Strings are encoded with `encode`; lists of ids are used as they are.
    """
    rows = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    if not rows or any(not r for r in rows):
      raise ValueError('Every prompt must have at least one token.')
    pad = pad_id if pad_id is not None else (self.pad_id if self.pad_id is not None else 0)
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), pad, np.int32)
    for b, row in enumerate(rows):
      tokens[b, :len(row)] = row
    return tokens, np.array([len(r) for r in rows], np.int32)

  def decode_result(self, result, **kwargs: Any) -> list[str]:
    """Each row of a `speclm.DecodeResult` (its generated tokens) as text."""
    return [self.decode(row, **kwargs) for row in result.to_lists()]

  # --- constructors -----------------------------------------------------------------------------

  @classmethod
  def from_tokenizer_json(cls, path: str | os.PathLike,
                          config: Mapping[str, Any] | None = None) -> 'Tokenizer':
    """From a `tokenizer.json` file, with special tokens and template from `config` (the
    contents of `tokenizer_config.json`) when given."""
    tokenizers = _tokenizers()
    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'No tokenizer file at {path!r}.')
    try:
      backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except  # the library raises bare Exception
      reason = ' '.join(str(e).split()) or type(e).__name__
      raise TokenizerFileError(f'{path} is not a readable tokenizer.json ({reason}); the file is'
                               ' truncated or corrupt: download or write it again.',
                               path=path) from e
    config = dict(config or {})

    def special(key):
      value = config.get(key)
      if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get('content')
      return None if value is None else backend.token_to_id(value)

    template = config.get('chat_template')
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t.get('name'): t.get('template') for t in template}
      template = named.get('default') or next(iter(named.values()), None)
    return cls(backend, bos_id=special('bos_token'), eos_id=special('eos_token'),
               pad_id=special('pad_token'), add_bos=False, chat_template=template)

  @classmethod
  def from_pretrained_dir(cls, directory: str | os.PathLike) -> 'Tokenizer':
    """From a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`,
    `chat_template.jinja` when present; the end tokens of `generation_config.json`)."""
    directory = os.fspath(directory)
    config: dict[str, Any] = {}
    config_path = os.path.join(directory, 'tokenizer_config.json')
    source = None
    if os.path.isfile(config_path):
      config = _read_json_object(config_path)
      source = config_path
    template_path = os.path.join(directory, 'chat_template.jinja')
    if 'chat_template' not in config and os.path.isfile(template_path):
      with open(template_path, encoding='utf-8') as f:
        config['chat_template'] = f.read()
      source = template_path
    tok = cls.from_tokenizer_json(os.path.join(directory, 'tokenizer.json'), config)
    tok.chat_template_source = source if tok.chat_template else None
    generation_path = os.path.join(directory, 'generation_config.json')
    if os.path.isfile(generation_path):
      ends = _read_json_object(generation_path).get('eos_token_id')
      if ends is not None:
        ends = [ends] if isinstance(ends, int) else ends
        tok.extra_end_ids += tuple(int(i) for i in ends)
    return tok


def _read_json_object(path: str) -> dict[str, Any]:
  """The JSON object in the file at `path`; a truncated or malformed file is a
  `TokenizerFileError` naming it (line and column)."""
  try:
    with open(path, encoding='utf-8') as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise TokenizerFileError(f'{path} is not valid JSON ({e.msg}: line {e.lineno} column'
                             f' {e.colno}); the file is truncated or corrupt: download or write'
                             ' it again.', path=path) from e
  except UnicodeDecodeError as e:
    raise TokenizerFileError(f'{path} is not UTF-8 text (byte {e.start}).', path=path) from e
  if not isinstance(value, dict):
    raise TokenizerFileError(f'{path} holds a JSON {type(value).__name__}, not an object.',
                             path=path)
  return value


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str = 'default', *,
                   added_tokens: Sequence[tuple[str, bool]] = (), source: str = ''):
  """A byte-level BPE `tokenizers.Tokenizer` (GPT-2 style) from its vocabulary and merges.

  Args:
    tokens: the vocabulary; a token's id is its index.
    merges: BPE merges as 'left right' strings, highest priority first.
    pre: how text is split before BPE, by llama.cpp's name (GGUF `tokenizer.ggml.pre`):
      'default'/'gpt2'/… (GPT-2's split), 'llama3'/'llama-bpe'/…, 'qwen2'/… (Llama 3's split
      with every digit alone), 'smollm'/'starcoder'/… (every digit alone, then GPT-2's split).
      Unknown names are a ValueError.
    added_tokens: (token, special) pairs matched whole before BPE (control and user-defined
      tokens such as `<|im_start|>`); special ones are dropped by `decode(...,
      skip_special_tokens=True)`.
    source: where the vocabulary came from, for error messages.
  """
  tokenizers = _tokenizers()
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel

  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = [tuple(m.split(' ', 1)) for m in merges]
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                            byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  if pre in _DIGIT_SPLIT_PRE:  # every digit its own piece, then GPT-2's split
    split = [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.Split(tokenizers.Regex(_GPT2_SPLIT), behavior='isolated')]
  elif pre in _GPT2_PRE:
    split = [pre_tokenizers.Split(tokenizers.Regex(_GPT2_SPLIT), behavior='isolated')]
  elif pre in _LLAMA3_PRE:
    split = [pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior='isolated')]
  elif pre in _QWEN2_PRE:
    split = [pre_tokenizers.Split(tokenizers.Regex(_QWEN2_SPLIT), behavior='isolated')]
  else:
    known = _DIGIT_SPLIT_PRE + _GPT2_PRE + _LLAMA3_PRE + _QWEN2_PRE
    raise ValueError(f'{source!r} asks for the pre-tokenizer {pre!r}, which speclm does not know;'
                     f' known: {", ".join(known)}.')
  backend.pre_tokenizer = pre_tokenizers.Sequence(split + [byte_level])
  backend.decoder = decoders.ByteLevel()
  added = [tokenizers.AddedToken(token, special=special, normalized=False)
           for token, special in added_tokens]
  if added:
    backend.add_tokens(added)
  return backend


# SentencePiece piece types (as GGUF's tokenizer.ggml.token_type stores them).
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                      add_space_prefix: bool = True, source: str = ''):
  """A `tokenizers.Tokenizer` equal to a SentencePiece BPE model (Llama 2, Gemma, Mistral v1)
  given its pieces, their scores and types (GGUF `tokenizer.ggml.model` 'llama').

  SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
  highest-scoring piece; a BPE merge list ranked by the merged piece's score does the same.
  Spaces become '▁'; characters no piece covers fall back to byte pieces `<0xXX>`; control
  and user-defined pieces (`<bos>`, `<start_of_turn>`) are matched whole. SentencePiece's
  dummy prefix (`add_space_prefix`) is a space before the whole text, special pieces
  included, which a `tokenizers` normalizer (applied between special pieces) cannot add:
  give `Tokenizer(space_prefix=add_space_prefix)` this backend; its decoder removes the space.
  """
  tokenizers = _tokenizers()
  from tokenizers import decoders, models, normalizers  # pylint: disable=import-outside-toplevel

  if not len(tokens) == len(scores) == len(types):
    raise ValueError(f'{source!r}: {len(tokens)} pieces, {len(scores)} scores and {len(types)}'
                     ' types; a SentencePiece vocabulary needs one of each per piece.')
  vocab = {token: i for i, token in enumerate(tokens)}
  mergeable = {token for token, kind in zip(tokens, types) if kind == _SP_NORMAL}
  merges = []
  for token, score, kind in zip(tokens, scores, types):
    if kind != _SP_NORMAL:
      continue
    for cut in range(1, len(token)):
      left, right = token[:cut], token[cut:]
      if left in mergeable and right in mergeable:
        merges.append((-float(score), vocab[token], cut, left, right))
  merges.sort()
  unknown = next((token for token, kind in zip(tokens, types) if kind == _SP_UNKNOWN), None)
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=[(left, right) for *_, left, right in merges], unk_token=unknown,
      fuse_unk=True, byte_fallback=True))
  backend.normalizer = normalizers.Replace(' ', '▁')
  decode_steps = [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse()]
  if add_space_prefix:
    decode_steps.append(decoders.Strip(' ', 1, 0))
  backend.decoder = decoders.Sequence(decode_steps)
  added = [tokenizers.AddedToken(token, special=kind == _SP_CONTROL, normalized=False)
           for token, kind in zip(tokens, types) if kind in (_SP_CONTROL, _SP_USER_DEFINED)]
  if added:
    backend.add_tokens(added)
  return backend


class _RenderBudget:
  """The time and size left to one rendering; `check` raises `ChatTemplateError` past either."""

  def __init__(self, source: str | None):
    self.source = source or 'the chat template'
    self.deadline = time.monotonic() + MAX_RENDER_SECONDS

  def fail(self, reason: str) -> ChatTemplateError:
    return ChatTemplateError(f'The chat template of {self.source} {reason}; fix the template'
                             ' (or pass chat=False / use a plain-text vocabulary).')

  def check(self, *values: Any) -> None:
    """Raises if the deadline passed or any of `values` is a string/list over the size cap."""
    if time.monotonic() > self.deadline:
      raise self.fail(f'ran longer than {MAX_RENDER_SECONDS:g} s (a loop without end?)')
    for value in values:
      if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDERED_CHARS:
        raise self.fail(f'built a value of {len(value):,} items, over the'
                        f' {MAX_RENDERED_CHARS:,} allowed')


def _bounded_environment(sandbox, jinja2_utils, budget: _RenderBudget):
  """A jinja2 `ImmutableSandboxedEnvironment` whose calls, filters, `range`, `*` and `**`
  check `budget`: a template can neither loop nor grow a string without bound."""

  class Bounded(sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(['*', '**'])

    def call(self, __context, __obj, *args, **kwargs):  # pylint: disable=no-self-argument
      budget.check(*args, *kwargs.values())
      result = super().call(__context, __obj, *args, **kwargs)
      budget.check(result)
      return result

    def call_binop(self, context, operator, left, right):
      budget.check()
      if operator == '*' and (isinstance(left, (str, list)) or isinstance(right, (str, list))):
        count = right if isinstance(left, (str, list)) else left
        size = len(left if isinstance(left, (str, list)) else right)
        if isinstance(count, int) and count * size > MAX_RENDERED_CHARS:
          raise budget.fail(f'multiplies a sequence to {count * size:,} items')
      if operator == '**' and isinstance(right, (int, float)) and abs(right) > 1024:
        raise budget.fail(f'raises a number to the power {right}')
      return super().call_binop(context, operator, left, right)

  env = Bounded(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)

  def bounded_range(*args):
    for i, value in enumerate(sandbox.safe_range(*args)):
      if i % 256 == 0:
        budget.check()
      yield value

  class BoundedNamespace(jinja2_utils.Namespace):
    """`namespace()` whose attributes (`{% set ns.s = … %}`) are size-checked."""

    def __setitem__(self, name, value):
      budget.check(value)
      super().__setitem__(name, value)

  env.globals['range'] = bounded_range
  env.globals['namespace'] = BoundedNamespace
  env.globals.pop('lipsum', None)
  for name, function in list(env.filters.items()):
    env.filters[name] = _bounded_filter(function, budget)
  return env


def _bounded_filter(function, budget: _RenderBudget):
  """`function` (a jinja2 filter) checking `budget` before and after each call (wraps keeps
  the attribute by which jinja2 passes it the environment or context)."""

  @functools.wraps(function)
  def bounded(*args, **kwargs):
    budget.check(*args[1:])
    if any(isinstance(a, int) and a > MAX_RENDERED_CHARS for a in (*args, *kwargs.values())):
      raise budget.fail(f'asked the filter {function.__name__} for over'
                        f' {MAX_RENDERED_CHARS:,} items')
    result = function(*args, **kwargs)
    budget.check(result)
    return result

  return bounded


def _render(template: str, source: str | None = None, **variables: Any) -> str:
  """`template` rendered with `variables` in a bounded sandbox (see the module docstring).

  Raises:
    ChatTemplateError: the template failed, was blocked by the sandbox, or passed a bound.
  """
  try:
    import jinja2  # pylint: disable=import-outside-toplevel
    from jinja2 import sandbox  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'Rendering chat templates needs `jinja2`. {_SETUP_HINT}') from e

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  budget = _RenderBudget(source)
  env = _bounded_environment(sandbox, jinja2.utils, budget)
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
  env.filters['tojson'] = _bounded_filter(
      lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent), budget)
  try:
    parts, size = [], 0
    for chunk in env.from_string(template).generate(**variables):
      size += len(chunk)
      if size > MAX_RENDERED_CHARS:
        raise budget.fail(f'wrote over {MAX_RENDERED_CHARS:,} characters')
      budget.check()
      parts.append(chunk)
  except ChatTemplateError:
    raise
  except sandbox.SecurityError as e:
    raise budget.fail(f'was stopped by the sandbox ({" ".join(str(e).split())})') from e
  except (jinja2.TemplateError, RecursionError, MemoryError, TypeError, ValueError,
          ArithmeticError, LookupError, AttributeError) as e:
    reason = ' '.join(str(e).split()) or type(e).__name__
    raise budget.fail(f'failed: {type(e).__name__}: {reason}') from e
  return ''.join(parts)
