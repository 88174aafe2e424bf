r"""The gin-configured decoding job: `python -m speclm.run --gin_file=FILE …`.

Decodes a dataset with speculative decoding, the plain baseline, or both, and writes an output
directory (see `speclm.outputs`): predictions.jsonl, metrics.json and the resolved config.gin.

  python -m speclm.run --gin_file=test_tiny.gin --gin.OUTPUT_DIR="'/tmp/tiny'"
  python -m speclm.run --gin_file=ende_small.gin \
      --gin.TARGET_CHECKPOINT="'gs://…/checkpoint_1000000'" \
      --gin.DRAFT_CHECKPOINT="'gs://…/checkpoint_1000000'" --gin.OUTPUT_DIR="'/tmp/ende'"

Flags, as in T5X: `--gin_file` (repeatable; found on the search path), `--gin_bindings`
(repeatable), `--gin.NAME=VALUE` (rewritten to the binding `NAME = VALUE`; strings need quotes:
`--gin.OUTPUT_DIR="'/tmp/x'"`), `--gin_search_paths` (comma-separated; the current directory
and the repository's `configs/` are always searched, after them).

Modes: 'speculative', 'baseline', 'compare' (both on the same batches and seeds; the report
says whether the outputs are identical, which greedy decoding guarantees).

Seams (each a zero-argument callable that gin passes uncalled, e.g. `@target/random_llama`):
  model provider       -> `speclm.protocol.Model`  (`random_llama`, `t5_checkpoint_model`,
                          `smollm2_model`, `ngram_draft`, `prompt_lookup_draft`,
                          `checkpoint_model`, or any function you register with gin)
  vocabulary provider  -> `speclm.data.Vocabulary` (`ByteVocabulary`, `SentencePieceVocabulary`,
                          `FunctionVocabulary`), or any tokenizer with encode/decode/vocab_size
                          (`smollm2_tokenizer`)
  dataset provider     -> list of `speclm.data.Example` (`file_dataset`, `synthetic_dataset`,
                          `seqio_dataset`)
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import logging as std_logging
import math
import os
import re
import sys
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from absl import logging
import gin
import jax
import numpy as np

from speclm import decoding
from speclm import outputs as outputs_lib
from speclm import partitioning
from speclm import progress as progress_lib
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm.data import inputs as inputs_lib
from speclm.data import seqio_tasks  # pylint: disable=unused-import  (registers seqio_dataset)
from speclm.data import vocab as vocab_lib
from speclm.job import fingerprint as fingerprint_lib
from speclm.models import llama

MODES = ('speculative', 'baseline', 'compare')
# The decoding methods each mode runs, in the order they run.
METHODS = {'speculative': ('speculative',), 'baseline': ('baseline',),
           'compare': ('baseline', 'speculative')}
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'configs')

_GIN_FILE = flags.DEFINE_multi_string(
    'gin_file', [], 'A gin file to parse (repeatable); looked up on the gin search path.')
_GIN_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], "A gin binding, e.g. run_job.batch_size=4 (repeatable). "
    '--gin.NAME=VALUE is a shorthand for --gin_bindings="NAME = VALUE".')
_GIN_SEARCH_PATHS = flags.DEFINE_list(
    'gin_search_paths', [], 'Directories searched for gin files and their includes, before the'
    " current directory and the repository's configs/.")


class JobError(Exception):
  """A problem with the job's configuration or inputs, reported as one paragraph (no trace)."""

  def __init__(self, message: str):
    super().__init__(message)
    self.message = message


# ----------------------------------------------------------------------------------------------
# Gin: flags, search paths, errors


def rewrite_gin_args(args: Sequence[str]) -> list[str]:
  """Rewrites each `--gin.NAME=VALUE` to `--gin_bindings=NAME = VALUE` (as T5X does)."""
  rewritten = []
  for arg in args:
    if arg.startswith('--gin.'):
      body = arg[len('--gin.'):]
      if '=' not in body:
        raise JobError(f'{arg} has no value. Write --gin.NAME=VALUE, e.g.'
                       ' --gin.run_job.batch_size=4 or --gin.OUTPUT_DIR="\'/tmp/out\'".')
      name, value = body.split('=', 1)
      arg = f'--gin_bindings={name} = {value}'
    rewritten.append(arg)
  return rewritten


def search_paths(extra: Sequence[str] = ()) -> list[str]:
  """Gin search path: the given directories, then '.', then the repository's configs/."""
  paths = [p for p in extra if p] + [os.getcwd(), CONFIGS_DIR]
  unique = []
  for path in paths:
    if path not in unique:
      unique.append(path)
  return unique


def _configurable_names() -> list[str]:
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  names = set()
  for selector, _ in registry.items():
    names.add(selector)
    names.add(selector.rsplit('.', 1)[-1])
  return sorted(names)


def _explain_gin_error(error: Exception) -> str:
  text = str(error).strip()
  first = text.splitlines()[0] if text else type(error).__name__
  where = ' '.join(line.strip() for line in text.splitlines()[1:3])
  match = re.search(r"No configurable matching '([^']+)'", text)
  if match:
    name = match.group(1).split('/')[-1]
    close = difflib.get_close_matches(name.rsplit('.', 1)[-1], _configurable_names(), n=3)
    hint = f' Did you mean {", ".join(close)}?' if close else ''
    return (f'Unknown gin binding: nothing is registered under the name {name!r} ({where}).'
            f'{hint} Check the spelling in the gin file or --gin flag.')
  match = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
  if match:
    return (f'Unknown gin binding: {match.group(1)} has no parameter {match.group(2)!r}'
            f' ({where}). Check the spelling in the gin file or --gin flag.')
  if 'Unable to open file' in text or isinstance(error, (IOError, OSError)):
    return (f'Gin file not found: {first} Pass the file by path, or add its directory with'
            ' --gin_search_paths.')
  return (f'Could not parse the gin configuration: {first} {where} Strings on the command'
          ' line need quotes inside the flag, e.g. --gin.OUTPUT_DIR="\'/tmp/out\'".')


def _is_required(value: Any) -> bool:
  return isinstance(value, gin.config.ConfigurableReference) and repr(value) == '%gin.REQUIRED'


def unset_required() -> list[str]:
  """Macros and bindings still set to `%gin.REQUIRED` after all files and flags are parsed."""
  missing = []
  for (scope, selector), params in gin.config._CONFIG.items():  # pylint: disable=protected-access
    for param, value in params.items():
      if _is_required(value):
        if selector == 'gin.macro':
          missing.append(scope)
        else:
          name = selector.rsplit('.', 1)[-1]
          missing.append(f'{scope + "/" if scope else ""}{name}.{param}')
  return sorted(missing)


def _required_message(names: Sequence[str]) -> str:
  examples = ' '.join(f'--gin.{n}=…' for n in names)
  return (f'Required setting{"s" if len(names) > 1 else ""} not provided: {", ".join(names)}.'
          f' Set {"them" if len(names) > 1 else "it"} in a gin file (e.g. {names[0]} = …) or on'
          f' the command line: {examples} (strings in quotes: --gin.{names[0]}="\'value\'").')


def warn(message: str) -> None:
  """One warning line on stderr (the job goes on)."""
  print(f'speclm.run: warning: {message}', file=sys.stderr)


_INCLUDE = re.compile(r"""^\s*include\s+(['"])(.+?)\1""", re.MULTILINE)


def _resolve_gin_file(name: str) -> str | None:
  """The file gin opens for `name`: the first search-path entry that has it."""
  prefixes = gin.config._LOCATION_PREFIXES if not os.path.isabs(name) else ['']  # pylint: disable=protected-access
  for prefix in prefixes:
    candidate = os.path.join(prefix, name)
    if os.path.isfile(candidate):
      return candidate
  return None


def shadowed_configs(gin_files: Sequence[str]) -> list[tuple[str, str]]:
  """(local file, repository file) for each gin file or include, followed recursively, that the
  search path finds outside configs/ although configs/ has a file of that name."""
  shadowed, seen, pending = [], set(), list(gin_files)
  while pending:
    name = pending.pop()
    resolved = _resolve_gin_file(name)
    if resolved is None or os.path.realpath(resolved) in seen:
      continue
    seen.add(os.path.realpath(resolved))
    ours = os.path.join(CONFIGS_DIR, name)
    if (not os.path.isabs(name) and os.path.isfile(ours)
        and os.path.realpath(ours) != os.path.realpath(resolved)):
      shadowed.append((os.path.abspath(resolved), ours))
    try:
      with open(resolved, encoding='utf-8') as f:
        pending += [m.group(2) for m in _INCLUDE.finditer(f.read())]
    except (OSError, UnicodeDecodeError):
      continue
  return shadowed


def _walk_references(value: Any, found: set[str]) -> None:
  if isinstance(value, gin.config.ConfigurableReference):
    if value._selector == 'gin.macro':  # pylint: disable=protected-access
      found.add(value._scopes[-1])  # pylint: disable=protected-access
  elif isinstance(value, (list, tuple)):
    for item in value:
      _walk_references(item, found)
  elif isinstance(value, dict):
    for item in value.values():
      _walk_references(item, found)


def unused_macros() -> tuple[list[str], list[str]]:
  """(macros nothing references, macros something references), after parsing."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  defined = {scope for scope, selector in config if selector == 'gin.macro'}
  used: set[str] = set()
  for params in config.values():
    for value in params.values():
      _walk_references(value, used)
  return sorted(defined - used), sorted(defined & used)


_MACRO_BINDING = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=')


def _check_macros(gin_bindings: Sequence[str]) -> None:
  """A macro set on the command line that nothing uses is a misspelling: stop and say so."""
  unused, used = unused_macros()
  if not unused:
    return
  from_flags = {m.group(1) for b in gin_bindings for m in [_MACRO_BINDING.match(b)] if m}
  for name in unused:
    close = difflib.get_close_matches(name, used, n=1)
    hint = f' Did you mean {close[0]}?' if close else ''
    if name in from_flags:
      raise JobError(f'--gin.{name} sets a macro that no configuration uses.{hint}')
    warn(f'the gin macro {name} is set but no configuration uses it.{hint}')


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str],
              gin_search_paths: Sequence[str] = ()) -> None:
  """Parses files then bindings (later ones win) and checks no required setting is left unset,
  no macro set on the command line goes unused, and says which repository gin files are
  shadowed by local files of the same name."""
  gin.clear_config()  # a fresh configuration each time (tools and tests parse more than once)
  for path in search_paths(gin_search_paths):
    gin.add_config_file_search_path(path)
  for local, ours in shadowed_configs(gin_files):
    warn(f'{local} shadows the repository\'s {os.path.relpath(ours, os.path.dirname(CONFIGS_DIR))}'
         ' (the search path finds it first); rename it to use the repository\'s file.')
  # Gin logs an error for every search-path entry that lacks a file, even when a later entry
  # has it; silence that while parsing (a file found nowhere still raises).
  std_logging.disable(std_logging.ERROR)
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings),
                                        finalize_config=False)
  except (ValueError, IOError, OSError, SyntaxError, TypeError) as e:
    raise JobError(_explain_gin_error(e)) from None
  finally:
    std_logging.disable(std_logging.NOTSET)
  missing = unset_required()
  if missing:
    raise JobError(_required_message(missing))
  _check_macros(gin_bindings)
  gin.finalize()


# ----------------------------------------------------------------------------------------------
# Gin-configurable pieces: sampling, γ per temperature, model providers


@gin.configurable
def sampling_config(temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0) -> sampling_lib.SamplingConfig:
  """`speclm.SamplingConfig` from gin (temperature 0 is greedy)."""
  return sampling_lib.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


@gin.configurable
def gamma_for_temperature(temperature: float = gin.REQUIRED, at_0: int = gin.REQUIRED,
                          at_1: int = gin.REQUIRED) -> int:
  """The paper's γ for this temperature (Table 2 lists γ for temperature 0 and 1 only)."""
  if temperature == 0:
    return at_0
  if temperature == 1:
    return at_1
  raise JobError(f'The paper gives γ only for temperature 0 and 1, not {temperature}. Set γ'
                 ' yourself with --gin.GAMMA=5 (any integer >= 1).')


@gin.configurable
def random_llama(vocab_size: int = 259, embed_dim: int = 32, num_layers: int = 2,
                 num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
                 dtype: str = 'float32', partitioner=None, role: str = 'target',
                 max_position_embeddings: int | None = None) -> protocol.Model:
  """A Llama with random weights (tests, smoke runs). Models made with the same seed share the
  weights of the layers they have in common, so a 1-layer draft of a 2-layer target agrees
  with it more often than an unrelated model. `max_position_embeddings`: its context length
  (None: unlimited)."""
  config = llama.LlamaConfig(
      vocab_size=vocab_size, num_layers=num_layers, embed_dim=embed_dim, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=max(2, embed_dim // num_heads), mlp_dim=2 * embed_dim,
      param_dtype=dtype, dtype=dtype, max_position_embeddings=max_position_embeddings)
  definition = llama.Llama(config)
  # One compiled initializer per definition: eager Flax init dispatches every op one by one,
  # which costs seconds per model on a busy CPU.
  model = protocol.Model(definition, _jit_init(definition, jax.random.key(seed)))
  return model if partitioner is None else partitioner.shard_model(model, role)


@functools.partial(jax.jit, static_argnums=0)
def _jit_init(definition, rng):
  return definition.init_params(rng)


def _check_path(path: str, what: str) -> None:
  if not path or not isinstance(path, str):
    raise JobError(f'The {what} path is not set (got {path!r}).')
  if '://' not in path and not os.path.exists(path):
    raise JobError(f'The {what} path {path} does not exist. Check the path (local paths are'
                   ' relative to the directory the job starts in) or point the setting at an'
                   ' existing checkpoint.')


@gin.configurable
def checkpoint_model(path: str = gin.REQUIRED,
                     loader: Callable[[str], protocol.Model] = gin.REQUIRED) -> protocol.Model:
  """Model provider for any checkpoint format: checks `path` exists, then `loader(path)`."""
  _check_path(path, 'checkpoint')
  return loader(path)


@gin.configurable
def t5_checkpoint_model(config: Any = gin.REQUIRED, checkpoint_path: str = gin.REQUIRED,
                        dtype: str | None = None, partitioner=None,
                        role: str = 'target', cpu_kernels: bool = False) -> protocol.Model:
  """A T5 (`speclm.models.t5`) restored from a T5X or Hugging Face checkpoint.

  `config` is a `T5Config`, e.g. the macro `%T5_1_1_XXL` of configs/models/t5_1_1/xxl.gin;
  scope the provider per model (`target/t5_checkpoint_model.config = %T5_1_1_XXL`) so the target
  and the draft can differ. `dtype` (e.g. 'bfloat16') overrides the config's dtypes.
  With the job's `partitioner` (run_job passes it), a legacy T5X checkpoint is read straight
  into its shards (each device reads its slice); other formats are read, then sharded.
  `cpu_kernels`: for float32 jobs on one CPU, every product through
  `speclm.kernels.cpu_matmul` (`t5.pack_for_cpu`; a no-op elsewhere).
  """
  _check_path(checkpoint_path, 'checkpoint')
  import dataclasses  # pylint: disable=g-import-not-at-top
  from speclm.checkpoints import t5x  # pylint: disable=g-import-not-at-top
  from speclm.models import t5  # pylint: disable=g-import-not-at-top
  if partitioner is not None and not os.path.isfile(os.path.join(checkpoint_path, 'config.json')
                                                    ) and not t5x.is_orbax_checkpoint(
                                                        checkpoint_path):
    from speclm.checkpoints import sharded  # pylint: disable=g-import-not-at-top
    if dtype is not None:
      config = dataclasses.replace(config, param_dtype=dtype, dtype=dtype)
    definition = t5.T5(config)
    try:
      params = sharded.load_t5x_sharded(checkpoint_path, definition, partitioner, role)
    except t5x.CheckpointError as e:
      raise JobError(str(e)) from None
    model = protocol.Model(definition, params)
  else:
    model = t5.t5_model(config=config, checkpoint_path=checkpoint_path, dtype=dtype)
    model = model if partitioner is None else partitioner.shard_model(model, role)
  # Packed copies are added after sharding: the kernel serves one-device jobs only.
  return t5.pack_for_cpu(model) if cpu_kernels else model


@gin.configurable
def smollm2_model(dtype: str = 'float32', cpu_kernels: bool = True) -> protocol.Model:
  """SmolLM2-135M-Instruct from its pip-installed GGUF file (`speclm.models.smollm2`).

  `cpu_kernels`: every projection through `speclm.kernels.cpu_matmul` on a one-device CPU
  job (`llama.pack_for_cpu`; a no-op elsewhere).
  """
  from speclm.models import smollm2  # pylint: disable=g-import-not-at-top
  return smollm2.load_model(dtype, cpu_kernels)


@gin.configurable
def smollm2_tokenizer():
  """SmolLM2's tokenizer (a `speclm.tokenizer.Tokenizer`; used as the job's vocabulary)."""
  from speclm.models import smollm2  # pylint: disable=g-import-not-at-top
  return smollm2.load_tokenizer()


@gin.configurable
def ngram_draft(path: str = gin.REQUIRED) -> protocol.Model:
  """A unigram or bigram draft saved by `speclm.models.ngram.save`."""
  _check_path(path, 'n-gram draft')
  from speclm.models import ngram  # pylint: disable=g-import-not-at-top
  return ngram.load(path)


@gin.configurable
def prompt_lookup_draft(vocab_size: int = gin.REQUIRED, max_ngram: int = 3,
                        min_ngram: int = 1) -> protocol.Model:
  """The prompt-lookup (copy) draft of `speclm.models.lookup`."""
  from speclm.models import lookup  # pylint: disable=g-import-not-at-top
  return lookup.prompt_lookup(vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)


@gin.configurable
def smollm2_draft_model(path: str | None = None, dtype: str = 'float32',
                        cpu_kernels: bool = True, lookup_min_ngram: int = 0) -> protocol.Model:
  """The trained draft shipped for SmolLM2-135M (`speclm.models.smollm2_draft`).

  It borrows SmolLM2's token embeddings, so loading it also loads (once) the target.
  `cpu_kernels`: as for `smollm2_model`. `lookup_min_ngram` n > 0: prompt lookup proposes
  instead wherever the last n+ tokens occurred before (`speclm.models.lookup.lookup_first`);
  the demo uses n = 2.
  """
  if path is not None:
    _check_path(path, 'SmolLM2 draft')
  if lookup_min_ngram < 0:
    raise ValueError(f'lookup_min_ngram must be >= 0 (0: off), got {lookup_min_ngram}.')
  from speclm.models import lookup  # pylint: disable=g-import-not-at-top
  from speclm.models import smollm2  # pylint: disable=g-import-not-at-top
  from speclm.models import smollm2_draft  # pylint: disable=g-import-not-at-top
  draft = smollm2_draft.load(smollm2.load_model(dtype), path, dtype, cpu_kernels)
  if lookup_min_ngram:
    draft = lookup.lookup_first(draft, min_ngram=lookup_min_ngram)
  return draft


@gin.configurable
def smollm2_chat_vocabulary() -> vocab_lib.Vocabulary:
  """SmolLM2's tokenizer with its chat template: each input is a user message."""
  from speclm.models import smollm2  # pylint: disable=g-import-not-at-top
  tok = smollm2.load_tokenizer()
  return vocab_lib.FunctionVocabulary(tok.encode_chat, tok.decode, tok.vocab_size,
                                      eos_id=tok.eos_id, pad_id=tok.pad_id or 0)


@gin.configurable
def builtin_prompts_dataset(name: str = 'demo', count: int | None = None
                            ) -> list[inputs_lib.Example]:
  """A built-in prompt set of `speclm.data.builtin_prompts`: 'demo', 'heldout' or 'training'."""
  from speclm.data import builtin_prompts  # pylint: disable=g-import-not-at-top
  sets = {'demo': builtin_prompts.demo_prompts, 'heldout': builtin_prompts.heldout_prompts,
          'training': builtin_prompts.training_prompts}
  if name not in sets:
    raise JobError(f'builtin_prompts_dataset.name must be one of {sorted(sets)}, got {name!r}.')
  prompts = sets[name]() if count is None else sets[name](count)
  return [inputs_lib.Example(index=i, id=f'{name}-{i}', input=p) for i, p in enumerate(prompts)]


def as_vocabulary(obj: Any) -> vocab_lib.Vocabulary:
  """A `Vocabulary`, or any tokenizer with encode, decode, vocab_size and eos_id, adapted."""
  if isinstance(obj, vocab_lib.Vocabulary):
    return obj
  if not all(hasattr(obj, name) for name in ('encode', 'decode', 'vocab_size')):
    raise JobError(f'The vocabulary provider returned {type(obj).__name__}, which has no'
                   ' encode/decode/vocab_size; wrap it in FunctionVocabulary.')
  return vocab_lib.FunctionVocabulary(obj.encode, obj.decode, obj.vocab_size,
                                      eos_id=getattr(obj, 'eos_id', None),
                                      pad_id=getattr(obj, 'pad_id', None) or 0)


def _accepted_kwargs(provider: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
  """The entries of `kwargs` that `provider` takes as parameters (e.g. `partitioner`)."""
  if not kwargs:
    return {}
  try:
    params = inspect.signature(provider).parameters
  except (TypeError, ValueError):
    return {}
  return {k: v for k, v in kwargs.items() if k in params}


def _provide(provider: Any, what: str, expected: type | None = None, **kwargs):
  """Calls a provider (or passes a ready object through), turning user errors into JobError.

  `kwargs` (e.g. the job's partitioner and the model's role) go to providers that accept them.
  """
  try:
    value = provider(**_accepted_kwargs(provider, kwargs)) if callable(provider) and not (
        expected is not None and isinstance(provider, expected)) else provider
  except JobError as e:
    raise JobError(f'{what}: {e.message}') from None
  except (FileNotFoundError, inputs_lib.DataError, ImportError) as e:
    raise JobError(f'{what} failed: {_clean(e)}') from None
  except ValueError as e:
    raise JobError(f'{what} failed: {_first_paragraph(e)}') from None
  if expected is not None and not isinstance(value, expected):
    raise JobError(f'{what} returned {type(value).__name__}, expected {expected.__name__}.')
  return value


def _clean(error: BaseException) -> str:
  """The error's message without the lines gin appends ("In call to configurable …")."""
  lines = [line for line in str(error).splitlines()
           if not line.strip().startswith(('In call to configurable', 'In scope'))]
  return '\n'.join(lines).strip()


def _first_paragraph(error: Exception) -> str:
  return _clean(error).split('\n\n')[0].strip()


# ----------------------------------------------------------------------------------------------
# The job


def _decode(method: str, target, draft, batch: inputs_lib.Batch, *, gamma, sampling,
            max_new_tokens, seed, eos_id, pad_id, partitioner=None) -> decoding.DecodeResult:
  common = dict(sampling=sampling, max_new_tokens=max_new_tokens, seed=seed, eos_id=eos_id,
                pad_id=pad_id, partitioner=partitioner)
  if method == 'speculative':
    result = decoding.speculative_decode(target, draft, batch.tokens, batch.lengths,
                                         gamma=gamma, **common)
  else:
    result = decoding.autoregressive_decode(target, batch.tokens, batch.lengths, **common)
  return jax.device_get(jax.block_until_ready(result))


def _decode_batch(batch: inputs_lib.Batch, methods: Sequence[str], target, draft,
                  vocabulary: vocab_lib.Vocabulary, warmed: set, *, exclude_compile_time: bool,
                  **decode_kwargs) -> tuple[list[dict[str, Any]], float]:
  """Decodes one batch with each method (same seed); returns its records and compile time."""
  results, times, compile_s = {}, {}, 0.0
  for method in methods:
    decode = functools.partial(_decode, method, target, draft, batch,
                               eos_id=vocabulary.eos_id, pad_id=vocabulary.pad_id,
                               **decode_kwargs)
    key = (method, batch.tokens.shape)
    if exclude_compile_time and key not in warmed:  # compile (and warm up) untimed
      start = time.perf_counter()
      decode()
      compile_s += time.perf_counter() - start
      warmed.add(key)
    start = time.perf_counter()
    results[method] = decode()
    times[method] = time.perf_counter() - start
  token_lists = {m: results[m].to_lists() for m in methods}
  records = []
  for row, item in enumerate(batch.examples):  # padding rows (past num_real) are dropped
    record = _base_record(item)
    record['batch'] = batch.examples[0].example.index  # rows decoded together share it
    record['batch_rows'] = batch.num_real  # a resume redoes a batch recorded only in part
    for method in methods:
      record[method] = _row_record(method, results[method], row, token_lists[method][row],
                                   vocabulary, times[method] / batch.num_real)
    if 'baseline' in methods and 'speculative' in methods:
      record['identical'] = token_lists['baseline'][row] == token_lists['speculative'][row]
    record['output'] = record[methods[-1]]['output']
    records.append(record)
  return records, compile_s


def _row_record(method: str, result: decoding.DecodeResult, row: int, tokens: list[int],
                vocabulary: vocab_lib.Vocabulary, time_s: float) -> dict[str, Any]:
  stats = result.stats
  record = {
      'output': vocabulary.decode(tokens),
      'tokens': tokens,
      'num_tokens': len(tokens),
      'stop_reason': decoding.StopReason(int(result.stop_reasons[row])).name,
      'target_calls': int(stats.target_calls_per_row[row]),
      'time_s': time_s,
  }
  if method == 'speculative':
    record.update(accepted=int(stats.accepted_per_row[row]),
                  beta_sum=float(stats.beta_sum_per_row[row]),
                  beta_count=int(stats.beta_count_per_row[row]))
  return record


ON_BAD_LOGITS = ('fail', 'warn')


class BadLogitsError(JobError):
  """The job finished and wrote its outputs, but some rows stopped on non-finite logits."""


class Interrupted(JobError):
  """Ctrl-C during a job: what was recorded stays, and rerunning the command resumes."""


@gin.configurable(denylist=['progress_stream'])
def run_job(*,
            mode: str = 'speculative',
            target: Any = gin.REQUIRED,
            draft: Any = None,
            vocabulary: Any = gin.REQUIRED,
            dataset: Any = gin.REQUIRED,
            output_dir: str = gin.REQUIRED,
            gamma: int = 4,
            sampling: Any = sampling_lib.GREEDY,
            max_new_tokens: int = 64,
            batch_size: int = 8,
            seed: int = 0,
            max_input_length: int = 512,
            length_buckets: Sequence[int] | None = None,
            on_too_long: str = 'truncate',
            add_eos_to_inputs: bool = False,
            max_examples: int | None = None,
            exclude_compile_time: bool = True,
            measure_cost: bool = True,
            reference_metrics: Sequence[str] = ('bleu', 'rouge'),
            show_progress: bool = True,
            partitioner: Any = None,
            overwrite: bool = False,
            on_bad_logits: str = 'fail',
            progress_stream=None) -> dict[str, Any]:
  """Decodes a dataset and writes predictions and metrics to `output_dir`; returns the metrics.

  Args:
    mode: 'speculative', 'baseline' or 'compare'.
    target, draft: model providers (the draft is unused by 'baseline').
    vocabulary: a vocabulary provider; its end token stops generation.
    dataset: a dataset provider.
    output_dir: where outputs go; a directory holding a killed run of the same job is resumed.
      A directory holding a different job (any setting in its job.json fingerprint differs,
      `speclm.job.fingerprint`) is refused before anything in it changes.
    gamma: tokens drafted per target call (γ).
    sampling: `speclm.SamplingConfig`, or a provider of one (`@sampling_config`); temperature
      0 is greedy.
    max_new_tokens: generation limit per example.
    batch_size: rows decoded together; short batches are padded to it.
    seed: base seed; each batch uses seed + its first example's index, in both methods.
    max_input_length, length_buckets, on_too_long, add_eos_to_inputs: input encoding (see
      `speclm.data.inputs.encode_examples`); buckets default to powers of two up to the limit.
      When the target (or draft) has a known context length, inputs are also held to that
      context less `max_new_tokens`, by the same `on_too_long` rule.
    max_examples: decode only the first N examples.
    exclude_compile_time: run each new batch shape once untimed first, so wall times (and the
      speedup) measure decoding, not XLA compilation.
    measure_cost: time one draft step against one target step to report c (and r, the cost of
      verifying γ+1 tokens relative to one) for Theorem 3.8's prediction.
    reference_metrics: 'bleu' (sacrebleu) and/or 'rouge' (rouge-score), computed when the
      examples have references and the package is installed.
    show_progress: print a progress bar with rate and ETA.
    partitioner: a `speclm.partitioning.Partitioner` (or a provider of one, e.g.
      `@partitioning.Partitioner()`): models are sharded over its mesh (the draft by its draft
      rules) and decoded with its shardings. None: one device.
    overwrite: discard whatever outputs `output_dir` holds and decode everything anew.
    on_bad_logits: rows that stopped on non-finite logits (`StopReason.BAD_LOGITS`) are counted
      in metrics.json and warned about in the summary; 'fail' (default) then raises
      `BadLogitsError` (the command exits 1), 'warn' only warns.

  Several processes (after `partitioning.initialize_distributed`): process p decodes the
  examples at positions p, p + P, p + 2P, … into `output_dir/process_<p>/`; after a barrier
  process 0 merges every part into `output_dir/predictions.jsonl` and writes the report.
  """
  job_start = time.perf_counter()
  if mode not in MODES:
    raise JobError(f"run_job.mode must be one of {MODES}, got {mode!r}.")
  if on_bad_logits not in ON_BAD_LOGITS:
    raise JobError(f'run_job.on_bad_logits must be one of {ON_BAD_LOGITS}, got'
                   f' {on_bad_logits!r}.')
  if on_too_long not in inputs_lib.ON_TOO_LONG:
    raise JobError(f'run_job.on_too_long must be one of {inputs_lib.ON_TOO_LONG}, got'
                   f' {on_too_long!r}.')
  methods = METHODS[mode]
  if mode != 'baseline' and draft is None:
    raise JobError(f"Mode {mode!r} needs a draft model: set run_job.draft (e.g. DRAFT ="
                   " @draft/random_llama), or use mode 'baseline'.")
  if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
    raise JobError(f'γ (run_job.gamma) must be an integer >= 1, got {gamma!r}.')
  sampling = _provide(sampling, 'The sampling setting', sampling_lib.SamplingConfig)
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise JobError(f'run_job.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.')
  buckets = tuple(sorted(length_buckets)) if length_buckets else inputs_lib.default_buckets(
      max_input_length)
  if buckets[-1] < max_input_length:
    raise JobError(f'The largest length bucket ({buckets[-1]}) is below max_input_length'
                   f' ({max_input_length}); add a bucket of at least that width.')

  process_index, process_count = jax.process_index(), jax.process_count()
  job_dir = output_dir if process_count == 1 else os.path.join(output_dir,
                                                                _process_dir(process_index))
  settings = {'mode': mode, 'gamma': gamma if 'speculative' in methods else None,
              'temperature': sampling.temperature, 'top_k': sampling.top_k,
              'top_p': sampling.top_p, 'max_new_tokens': max_new_tokens, 'seed': seed,
              'batch_size': batch_size, 'max_input_length': max_input_length,
              'length_buckets': list(buckets), 'on_too_long': on_too_long,
              'add_eos_to_inputs': add_eos_to_inputs, 'max_examples': max_examples}

  # 1. The output directory: locked, then checked against what the job is about to do. Nothing
  #    in it is written until the job has accepted it (step 3).
  try:
    out = outputs_lib.OutputDir(job_dir)
  except outputs_lib.OutputError as e:
    raise JobError(str(e)) from None
  recorded_this_run = 0
  try:
    if overwrite:
      deleted = out.discard()
      if deleted:
        warn(f'run_job.overwrite: discarded {", ".join(deleted)} in {job_dir}.')
    _check_model_paths()  # a missing checkpoint is reported before the vocabulary loads
    vocabulary = as_vocabulary(_provide(vocabulary, 'Loading the vocabulary'))
    examples = list(_provide(dataset, 'Reading the dataset'))
    if max_examples is not None:
      examples = examples[:max_examples]
    if process_count > 1:  # this process's share; process 0 merges the parts
      examples = examples[process_index::process_count]
    if not examples:
      raise JobError('The dataset is empty: no examples to decode. Check the dataset path,'
                     ' format and filters (file_dataset.path, seqio_dataset.split,'
                     ' run_job.max_examples).')
    fingerprint = fingerprint_lib.job_fingerprint(settings, inputs_lib.fingerprint(examples),
                                                  len(examples))
    try:
      out.check(fingerprint, partial=True)  # before the (slow) model loading
    except outputs_lib.OutputError as e:
      raise JobError(str(e)) from None

    # 2. Models (placed in their shards when a partitioner is set).
    if partitioner is not None:
      partitioner = _provide(partitioner, 'Building the device mesh', partitioning.Partitioner)
      if process_count > 1 and not partitioner.is_local:
        raise JobError(
            'partitioning.Partitioner.devices is global, but each process decodes its own'
            ' share of the dataset; a mesh over several processes needs the same batches on'
            " every process. Use devices = 'local' (one model replica per host).")
    target_model = _provide(target, 'Loading the target model', protocol.Model,
                            partitioner=partitioner, role='target')
    draft_model = (_provide(draft, 'Loading the draft model', protocol.Model,
                            partitioner=partitioner, role='draft')
                   if 'speculative' in methods else None)
    if partitioner is not None:
      target_model = _ensure_sharded(partitioner, target_model, 'target')
      draft_model = (None if draft_model is None
                     else _ensure_sharded(partitioner, draft_model, 'draft'))
    if vocabulary.vocab_size > target_model.vocab_size:
      raise JobError(f'The vocabulary has {vocabulary.vocab_size} ids but the target model'
                     f' only {target_model.vocab_size}; they do not belong together.')
    if draft_model is not None and draft_model.vocab_size != target_model.vocab_size:
      raise JobError(f'The draft and target vocabularies differ ({draft_model.vocab_size} vs'
                     f' {target_model.vocab_size} tokens); speculative decoding needs one'
                     ' shared vocabulary.')
    input_limit = _input_limit(max_input_length, max_new_tokens, target_model, draft_model)
    try:
      encoded = inputs_lib.encode_examples(
          examples, vocabulary, max_input_length=input_limit, on_too_long=on_too_long,
          add_eos=add_eos_to_inputs)
    except inputs_lib.DataError as e:
      raise JobError(str(e)) from None

    # 3. The directory is accepted: the full fingerprint (models included) is recorded or
    #    matched, and only now does anything in it change.
    fingerprint.update(fingerprint_lib.model_entries({'target': target_model,
                                                      'draft': draft_model}))
    try:
      done = out.resume(fingerprint)
    except outputs_lib.OutputError as e:
      raise JobError(str(e)) from None
    outputs_lib.write_atomic(out.file(outputs_lib.CONFIG), gin.config_str())
    _report_truncation(encoded, done, input_limit, max_input_length, progress_stream)

    # 4. Examples skipped by the length rule are recorded once, like decoded ones.
    skipped = [e for e in encoded if e.skipped and e.example.index not in done]
    if skipped:
      out.append([_base_record(e) for e in skipped])
    pending = [e for e in encoded if not e.skipped and e.example.index not in done]
    batches = inputs_lib.make_batches(pending, batch_size=batch_size, buckets=buckets,
                                      pad_id=vocabulary.pad_id)
    num_done = len(examples) - len(pending)
    if done:
      print(f'Resuming {output_dir}: {len(done)} of {len(examples)} examples already recorded.',
            file=progress_stream or sys.stderr)
    bar = progress_lib.Progress(len(examples), initial=num_done, stream=progress_stream,
                                enabled=show_progress,
                                label='compare' if mode == 'compare' else methods[0])
    warmed: set[tuple[str, tuple[int, ...]]] = set()
    compile_s = 0.0
    try:
      for batch in batches:
        records, batch_compile_s = _decode_batch(
            batch, methods, target_model, draft_model, vocabulary, warmed,
            exclude_compile_time=exclude_compile_time, gamma=gamma, sampling=sampling,
            max_new_tokens=max_new_tokens, seed=seed + batch.examples[0].example.index,
            partitioner=partitioner)
        compile_s += batch_compile_s
        out.append(records)
        recorded_this_run += len(records)
        bar.update(batch.num_real, sum(r[methods[-1]]['num_tokens'] for r in records))
    except KeyboardInterrupt:
      bar.close()
      raise Interrupted(
          f'interrupted after {recorded_this_run} examples ({num_done + recorded_this_run} of'
          f' {len(examples)} recorded in {job_dir}); rerun the same command to resume.'
      ) from None
    bar.close()

    # 5. The report covers every recorded example, this run's and earlier runs'.
    all_records = outputs_lib.read_predictions(out.predictions_path)
    cost = None
    if measure_cost and draft_model is not None:
      cost = _measure_cost(target_model, draft_model, gamma=gamma, batch_size=batch_size,
                           context_length=min(buckets[0], max_input_length))
    metrics = compute_metrics(all_records, mode=mode, gamma=gamma, sampling=sampling,
                              cost=cost, reference_metrics=reference_metrics)
    metrics['job'] = {'wall_time_s': time.perf_counter() - job_start,
                      'compile_and_warmup_s': compile_s, 'batch_size': batch_size,
                      'max_new_tokens': max_new_tokens, 'length_buckets': list(buckets),
                      'input_limit': input_limit,
                      'decoded_this_run': len(pending), 'resumed_from': len(done),
                      'output_dir': job_dir, 'process_index': process_index,
                      'process_count': process_count}
    if partitioner is not None:
      metrics['job']['mesh'] = partitioner.mesh_shape
    outputs_lib.write_json_atomic(out.file(outputs_lib.METRICS), metrics)
    outputs_lib.write_atomic(out.file(outputs_lib.OPERATIVE_CONFIG), gin.operative_config_str())
  except KeyboardInterrupt:
    raise Interrupted(f'interrupted after {recorded_this_run} examples; rerun the same command'
                      ' to resume.') from None
  finally:
    out.close()
  if process_count > 1:
    metrics = _merge_processes(output_dir, process_index, process_count, metrics, mode=mode,
                               gamma=gamma, sampling=sampling,
                               reference_metrics=reference_metrics)
  print(summary(metrics))
  if metrics.get('num_bad_logits'):
    message = (f"{metrics['num_bad_logits']} of {metrics['num_decoded']} examples stopped on"
               ' non-finite (NaN/inf) logits (stop reason BAD_LOGITS; their outputs end before'
               f' it). Check the checkpoints for NaN/Inf; outputs are in {output_dir}.')
    if on_bad_logits == 'fail':
      raise BadLogitsError(message + " Set run_job.on_bad_logits = 'warn' to only warn.")
    warn(message)
  return metrics


def _input_limit(max_input_length: int, max_new_tokens: int, *models) -> int:
  """Input tokens allowed: `max_input_length`, and the shortest model context less the new
  tokens (models with no known context length do not limit it)."""
  contexts = [c for m in models if m is not None
              for c in [getattr(m.definition, 'max_context_length', None)] if c]
  if not contexts:
    return max_input_length
  room = min(contexts) - max_new_tokens
  if room < 1:
    raise JobError(f'run_job.max_new_tokens={max_new_tokens} leaves no room for an input in'
                   f' the model context of {min(contexts)} tokens; lower MAX_NEW_TOKENS.')
  return min(max_input_length, room)


def _report_truncation(encoded, done, input_limit, max_input_length, stream) -> None:
  truncated = sum(1 for e in encoded if e.truncated and e.example.index not in done)
  if truncated:
    why = ('max_input_length' if input_limit == max_input_length else
           'the model context less max_new_tokens')
    print(f'{truncated} input(s) truncated to {input_limit} tokens ({why}).',
          file=stream or sys.stderr)


# Model-provider parameters that name a checkpoint path, checked before anything loads.
_PATH_PARAMS = ('checkpoint_path', 'path')


def _binding(scopes: Sequence[str], selector: str, param: str) -> Any:
  """The value gin binds to `param` of `selector` under `scopes` (innermost first), with
  macros resolved; None when unbound."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  for depth in range(len(scopes), -1, -1):
    scope = '/'.join(scopes[:depth])
    params = config.get((scope, selector), {})
    if param in params:
      return fingerprint_lib.resolve_macros(params[param])
  return None


def _check_model_paths() -> None:
  """The checkpoint paths of the job's target and draft providers exist (local paths only).

  Providers check their own paths too; this runs first so that a missing checkpoint is the
  first thing reported, before the vocabulary or dataset load.
  """
  config = gin.config._CONFIG  # pylint: disable=protected-access
  job = next((params for (scope, selector), params in config.items()
              if not scope and selector.rsplit('.', 1)[-1] == 'run_job'), {})
  for role in ('target', 'draft'):
    provider = fingerprint_lib.resolve_macros(job.get(role))
    if not isinstance(provider, gin.config.ConfigurableReference):
      continue
    scopes, selector = provider._scopes, provider._configurable.selector  # pylint: disable=protected-access
    for param in _PATH_PARAMS:
      path = _binding(scopes, selector, param)
      if isinstance(path, str) and path:
        _check_path(path, f'{role} checkpoint ({selector.rsplit(".", 1)[-1]}.{param})')


def _process_dir(process_index: int) -> str:
  return f'process_{process_index:03d}'


def _ensure_sharded(partitioner, model: protocol.Model, role: str) -> protocol.Model:
  """The model with parameters on the partitioner's mesh (providers that took the
  partitioner already placed them; others are sharded here from their host copy)."""
  leaves = jax.tree.leaves(model.params)
  mesh = partitioner.mesh
  if all(isinstance(x, jax.Array) and getattr(x.sharding, 'mesh', None) == mesh
         for x in leaves):
    return model
  return partitioner.shard_model(model, role)


def _merge_processes(output_dir: str, process_index: int, process_count: int,
                     metrics: dict[str, Any], **report_kwargs) -> dict[str, Any]:
  """Process 0 gathers every process's predictions and writes the merged report.

  The records travel over JAX's own collectives (`process_allgather`), not a shared file
  system: on a TPU slice each host writes its part to its own disk (`process_<p>/`), and only
  process 0's `output_dir` gets the merged predictions.jsonl and metrics.json.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  own = os.path.join(output_dir, _process_dir(process_index), outputs_lib.PREDICTIONS)
  with open(own, 'rb') as f:
    data = np.frombuffer(f.read(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64)))
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[:data.size] = data
  parts = np.asarray(multihost_utils.process_allgather(padded))  # [processes, bytes]
  if process_index == 0:
    records, seen = [], set()
    for p in range(process_count):
      text = parts[p, :int(sizes.reshape(-1)[p])].tobytes()
      for line in text.splitlines():
        if not line.strip():
          continue
        record = json.loads(line)
        if record['index'] in seen:
          raise JobError(f'Example {record["index"]} was decoded by two processes; the'
                         f' process directories under {output_dir} belong to different jobs.')
        seen.add(record['index'])
        records.append(record)
    records.sort(key=lambda r: r['index'])
    outputs_lib.write_atomic(os.path.join(output_dir, outputs_lib.PREDICTIONS),
                             ''.join(json.dumps(r, ensure_ascii=False, allow_nan=True) + '\n'
                                     for r in records))
    merged = compute_metrics(records, cost=metrics.get('cost_measurement'), **report_kwargs)
    merged['job'] = dict(metrics['job'], output_dir=output_dir, process_index=0,
                         merged_from=[_process_dir(p) for p in range(process_count)])
    outputs_lib.write_json_atomic(os.path.join(output_dir, outputs_lib.METRICS), merged)
    metrics = merged
  multihost_utils.sync_global_devices('speclm.run: the report is written')
  return metrics


def _base_record(item: inputs_lib.EncodedExample) -> dict[str, Any]:
  example = item.example
  record = {'index': example.index, 'id': example.id, 'input': example.input,
            'input_tokens': item.length, 'truncated': item.truncated}
  if example.reference is not None:
    record['reference'] = example.reference
  if item.skipped:
    record['skipped'] = item.skipped
  return record


def _measure_cost(target, draft, *, gamma, batch_size, context_length) -> dict[str, Any] | None:
  try:
    from speclm.analysis import measure  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  estimate = measure.measure_costs(target, draft, gamma=gamma, batch_size=batch_size,
                                   context_length=context_length, num_steps=4, repeats=3)
  return estimate.to_dict()


# ----------------------------------------------------------------------------------------------
# Metrics


def _theory():
  try:
    from speclm.analysis import theory  # pylint: disable=g-import-not-at-top
    return theory
  except ImportError:
    return None


def _predicted_speedup(alpha: float, gamma: int, c: float, r: float = 1.0) -> float | None:
  """Theorem 3.8, (1 − α^(γ+1)) / ((1 − α)(γc + r)) (r = 1 is the paper's form)."""
  if alpha is None or c is None or math.isnan(alpha):
    return None
  theory = _theory()
  if theory is not None:
    return float(theory.walltime_improvement(alpha, gamma, c, r))
  tokens = gamma + 1.0 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
  return tokens / (gamma * c + r)


def _predicted_speedup_per_batch(records: list[dict[str, Any]], gamma: int,
                                 cost: dict[str, Any]) -> float | None:
  """Theorem 3.8 row by row (`theory.batch_walltime_improvement`), over the job's batches.

  A batch runs until its slowest row is done: E[max_b R_b] iterations for the tokens each row
  made after its first (the prefill makes that one in both methods), from each row's own α,
  against the baseline's calls for its longest row. None for records without a batch key
  (jobs written before it existed) or without the analysis package.
  """
  theory = _theory()
  if theory is None or any('batch' not in r for r in records):
    return None
  batches: dict[int, list[dict[str, Any]]] = {}
  for record in records:
    batches.setdefault(record['batch'], []).append(record['speculative'])
  baseline_calls, iterations = 0, 0.0
  for rows in batches.values():
    counts = [max(row['num_tokens'] - 1, 0) for row in rows]
    if max(counts) == 0:
      continue
    alphas = [min(row['beta_sum'] / row['beta_count'], 1.0) if row['beta_count'] else 0.0
              for row in rows]
    baseline_calls += max(counts)
    iterations += theory.expected_batch_iterations(alphas, gamma, counts)
  if not iterations:
    return None
  return baseline_calls / (iterations * (gamma * cost['c'] + cost['r']))


def _reference_scores(hypotheses: list[str], references: list[str],
                      wanted: Sequence[str]) -> tuple[dict[str, float], list[str]]:
  scores, notes = {}, []
  if 'bleu' in wanted:
    try:
      import sacrebleu  # pylint: disable=g-import-not-at-top
      scores['bleu'] = float(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    except ImportError:
      notes.append('BLEU skipped: pip install sacrebleu.')
  if 'rouge' in wanted:
    try:
      from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top
      from rouge_score import scoring  # pylint: disable=g-import-not-at-top
      kinds = ['rouge1', 'rouge2', 'rougeLsum']
      scorer = rouge_scorer.RougeScorer(kinds)
      aggregator = scoring.BootstrapAggregator()
      for ref, hyp in zip(references, hypotheses):
        # rougeLsum treats newlines as sentence boundaries, as T5's evaluation does.
        aggregator.add_scores(scorer.score(ref, hyp))
      result = aggregator.aggregate()
      for kind in kinds:
        scores[kind] = float(result[kind].mid.fmeasure * 100)
    except ImportError:
      notes.append('ROUGE skipped: pip install rouge-score.')
  return scores, notes


def compute_metrics(records: list[dict[str, Any]], *, mode: str, gamma: int,
                    sampling: sampling_lib.SamplingConfig, cost: dict[str, Any] | None = None,
                    reference_metrics: Sequence[str] = ('bleu', 'rouge')) -> dict[str, Any]:
  """The metrics.json report from prediction records (all of the job's examples)."""
  methods = METHODS[mode]
  decoded = [r for r in records if 'skipped' not in r]
  notes: list[str] = []
  metrics: dict[str, Any] = {
      'mode': mode, 'gamma': gamma if 'speculative' in methods else None,
      'sampling': {'temperature': sampling.temperature, 'top_k': sampling.top_k,
                   'top_p': sampling.top_p},
      'num_examples': len(records), 'num_decoded': len(decoded),
      'num_skipped': len(records) - len(decoded),
      'num_truncated': sum(1 for r in records if r.get('truncated')),
      # Rows cut short by non-finite logits: their numbers must not pass unnoticed.
      'num_bad_logits': sum(1 for r in decoded
                            if any(r[m]['stop_reason'] == 'BAD_LOGITS' for m in methods)),
  }
  with_refs = [r for r in decoded if r.get('reference') is not None]
  for method in methods:
    rows = [r[method] for r in decoded]
    time_s = sum(r['time_s'] for r in rows)
    tokens = sum(r['num_tokens'] for r in rows)
    calls = sum(r['target_calls'] for r in rows)
    entry = {
        'decode_time_s': time_s, 'tokens': tokens,
        'tokens_per_s': tokens / time_s if time_s > 0 else None,
        'examples_per_s': len(rows) / time_s if time_s > 0 else None,
        'mean_output_tokens': tokens / len(rows) if rows else None,
        'target_calls': calls,
        'tokens_per_target_call': tokens / calls if calls else None,
        'stop_reasons': _count(r['stop_reason'] for r in rows),
    }
    if method == 'speculative':
      beta_count = sum(r['beta_count'] for r in rows)
      entry['alpha'] = sum(r['beta_sum'] for r in rows) / beta_count if beta_count else None
      entry['accepted_tokens'] = sum(r['accepted'] for r in rows)
    if with_refs and reference_metrics:
      scores, score_notes = _reference_scores([r[method]['output'] for r in with_refs],
                                              [r['reference'] for r in with_refs],
                                              reference_metrics)
      entry.update(scores)
      notes += [n for n in score_notes if n not in notes]
    metrics[method] = entry

  if 'speculative' in methods:
    spec = metrics['speculative']
    alpha = spec['alpha']
    metrics['alpha'] = alpha
    metrics['tokens_per_target_call'] = spec['tokens_per_target_call']
    theory = _theory()
    metrics['expected_tokens_per_iteration'] = (
        None if alpha is None else
        float(theory.expected_tokens_per_iteration(alpha, gamma)) if theory else
        (gamma + 1.0 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)))
    if cost is not None:
      metrics['c'] = cost['c']
      metrics['r'] = cost['r']
      metrics['cost_measurement'] = cost
      metrics['predicted_speedup_theorem_3_8'] = _predicted_speedup(alpha, gamma, cost['c'])
      metrics['predicted_speedup_with_r'] = _predicted_speedup(alpha, gamma, cost['c'],
                                                                cost['r'])
      metrics['predicted_speedup_per_batch'] = _predicted_speedup_per_batch(decoded, gamma,
                                                                            cost)
    else:
      metrics['c'] = None
      metrics['predicted_speedup_theorem_3_8'] = None
      notes.append('c was not measured (run_job.measure_cost = False), so there is no Theorem'
                   ' 3.8 prediction; (1 − α^(γ+1)) / ((1 − α)(γc + 1)) gives it for any c.')
  if mode == 'compare':
    base, spec = metrics['baseline'], metrics['speculative']
    metrics['speedup'] = (base['decode_time_s'] / spec['decode_time_s']
                          if spec['decode_time_s'] > 0 else None)
    metrics['identical_output_rate'] = (
        sum(1 for r in decoded if r['identical']) / len(decoded) if decoded else None)
    if not sampling.is_greedy:
      notes.append('At temperature > 0 both methods sample the same distribution but not the'
                   ' same random draws, so identical outputs are not expected.')
  metrics['wall_time_s'] = {m: metrics[m]['decode_time_s'] for m in methods}
  metrics['notes'] = notes
  return metrics


def _count(values) -> dict[str, int]:
  counts: dict[str, int] = {}
  for value in values:
    counts[value] = counts.get(value, 0) + 1
  return counts


def _fmt(value, spec: str = '.3f') -> str:
  if value is None:
    return 'n/a'
  if isinstance(value, float):
    return format(value, spec)
  return str(value)


def summary(metrics: dict[str, Any]) -> str:
  """The short table printed at the end of a job."""
  rows = [('mode', metrics['mode']),
          ('examples', f"{metrics['num_decoded']} decoded, {metrics['num_skipped']} skipped,"
                       f" {metrics['num_truncated']} truncated")]
  for method in ('baseline', 'speculative'):
    if method in metrics:
      entry = metrics[method]
      rows.append((f'{method} time', f"{_fmt(entry['decode_time_s'])} s,"
                                     f" {_fmt(entry['tokens_per_s'], '.1f')} tokens/s"))
      for key in ('bleu', 'rouge1', 'rouge2', 'rougeLsum'):
        if key in entry:
          rows.append((f'{method} {key}', _fmt(entry[key], '.2f')))
  if 'alpha' in metrics:
    rows += [('alpha (measured)', _fmt(metrics['alpha'])),
             ('tokens / target call', _fmt(metrics['tokens_per_target_call'])),
             ('c (measured)', _fmt(metrics.get('c'))),
             ('r (measured)', _fmt(metrics.get('r'))),
             ('Theorem 3.8 speedup', _fmt(metrics.get('predicted_speedup_theorem_3_8'), '.2f')),
             ('  with measured r', _fmt(metrics.get('predicted_speedup_with_r'), '.2f')),
             ('  row by row, per batch', _fmt(metrics.get('predicted_speedup_per_batch'),
                                              '.2f'))]
  if 'speedup' in metrics:
    rows += [('measured speedup', _fmt(metrics['speedup'], '.2f')),
             ('identical outputs', _fmt(metrics['identical_output_rate'], '.1%'))]
  if metrics.get('num_bad_logits'):
    rows.append(('WARNING', f"{metrics['num_bad_logits']} example(s) stopped on NaN/inf logits"
                            ' (BAD_LOGITS); the figures above include them'))
  if 'job' in metrics:
    rows.append(('output dir', metrics['job']['output_dir']))
  return progress_lib.table(rows, title='speclm run summary')


# ----------------------------------------------------------------------------------------------
# A job's models and prompts, for other tools (speclm.analysis)


@gin.configurable
def job_parts(target: Any = gin.REQUIRED, draft: Any = None, vocabulary: Any = None,
              dataset: Any = None, max_input_length: int = 512):
  """The providers a gin job names; `load_job` binds them to the job's macros."""
  return target, draft, vocabulary, dataset, max_input_length


_JOB_PARTS_BINDINGS = (
    'OUTPUT_DIR = None',  # a tool that only loads the job's parts writes no outputs
    'job_parts.target = %TARGET', 'job_parts.draft = %DRAFT',
    'job_parts.vocabulary = %VOCABULARY', 'job_parts.dataset = %DATASET',
    'job_parts.max_input_length = %MAX_INPUT_LENGTH')


def load_job(gin_files: Sequence[str], gin_bindings: Sequence[str] = (),
             gin_search_paths: Sequence[str] = ()) -> dict[str, Any]:
  """The target, draft and encoded prompts of a gin job (its TARGET, DRAFT, VOCABULARY,
  DATASET and MAX_INPUT_LENGTH macros), without running it.

  Returns a dict with 'target', 'draft' (`protocol.Model`s), 'prompts' `[N, P]`,
  'prompt_lengths' `[N]` (right-padded token ids) and 'eos_id'.
  """
  parse_gin(gin_files, list(gin_bindings) + list(_JOB_PARTS_BINDINGS), gin_search_paths)
  target, draft, vocabulary, dataset, max_input_length = job_parts()  # pylint: disable=no-value-for-parameter
  vocabulary = as_vocabulary(_provide(vocabulary, 'Loading the vocabulary'))
  examples = list(_provide(dataset, 'Reading the dataset'))
  if not examples:
    raise JobError('The dataset is empty: no prompts to measure on.')
  try:
    encoded = [e for e in inputs_lib.encode_examples(examples, vocabulary,
                                                     max_input_length=max_input_length)
               if e.skipped is None]
  except inputs_lib.DataError as e:
    raise JobError(str(e)) from None
  width = max(e.length for e in encoded)
  prompts = np.full((len(encoded), width), vocabulary.pad_id, np.int32)
  for row, item in enumerate(encoded):
    prompts[row, :item.length] = item.ids
  return {
      'target': _provide(target, 'Loading the target model', protocol.Model),
      'draft': None if draft is None else _provide(draft, 'Loading the draft model',
                                                   protocol.Model),
      'prompts': prompts,
      'prompt_lengths': np.array([e.length for e in encoded], np.int32),
      'eos_id': vocabulary.eos_id,
  }


# ----------------------------------------------------------------------------------------------
# Several temperatures in one command


@gin.configurable
def run_sweep(temperatures: Sequence[float] = gin.REQUIRED, output_dir: str = gin.REQUIRED,
              show_outputs: int = 0, progress_stream=None) -> dict[float, dict[str, Any]]:
  """Runs `run_job` once per temperature, into `output_dir/temperature_<T>`.

  Every other setting comes from `run_job`'s bindings; `show_outputs` prints that many decoded
  texts of each run (the embedded demo shows a few).
  """
  if not temperatures:
    raise JobError('run_sweep.temperatures is empty; give at least one, e.g. [0.0, 1.0].')
  results, bad = {}, []
  for temperature in temperatures:
    sub_dir = os.path.join(output_dir, f'temperature_{temperature:g}')
    print(f'\n=== temperature {temperature:g} -> {sub_dir}', file=progress_stream or sys.stdout)
    try:
      metrics = run_job(sampling=sampling_lib.SamplingConfig(  # pylint: disable=missing-kwoa
          temperature=float(temperature)), output_dir=sub_dir, progress_stream=progress_stream)
    except BadLogitsError as e:  # the other temperatures still run; the sweep fails at the end
      bad.append(f'temperature {temperature:g}: {e.message}')
      continue
    if show_outputs:
      method = 'speculative' if metrics['mode'] != 'baseline' else 'baseline'
      records = sorted(outputs_lib.read_predictions(os.path.join(sub_dir,
                                                                 outputs_lib.PREDICTIONS)),
                       key=lambda r: r['index'])
      for record in records[:show_outputs]:
        if method in record:
          print(f"\n> {record['input']}\n{record[method]['output'].strip()}",
                file=progress_stream or sys.stdout)
    results[float(temperature)] = metrics
  if bad:
    raise BadLogitsError(' '.join(bad))
  return results


def _sweep_requested() -> bool:
  try:
    return gin.query_parameter('run_sweep.temperatures') is not None
  except ValueError:
    return False


# ----------------------------------------------------------------------------------------------
# Entry point


def _required_call_error(error: Exception) -> str | None:
  match = re.search(r"Required bindings for `([^`]+)` not provided in config: \[([^\]]*)\]",
                    str(error))
  if not match:
    return None
  configurable = match.group(1).rsplit('.', 1)[-1]
  names = [f'{configurable}.{p.strip().strip(chr(39))}' for p in match.group(2).split(',')]
  return _required_message(names)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # gin's file lookups log at INFO
  try:
    if not _GIN_FILE.value:
      raise JobError('No gin file given. Run e.g. python -m speclm.run'
                     ' --gin_file=test_tiny.gin --gin.OUTPUT_DIR="\'/tmp/out\'".')
    parse_gin(_GIN_FILE.value, _GIN_BINDINGS.value, _GIN_SEARCH_PATHS.value)
    # Before gin builds any argument of run_job (a vocabulary written `@Vocabulary()` is built
    # when run_job is called): a missing checkpoint is the first thing reported.
    _check_model_paths()
    partitioning.initialize_distributed()  # only when gin enables it; before any JAX work
    if _sweep_requested():
      run_sweep()  # pylint: disable=no-value-for-parameter
    else:
      run_job()  # pylint: disable=missing-kwoa
  except Interrupted as e:
    _fail(e.message, status=130, prefix='')
  except KeyboardInterrupt:
    _fail('interrupted before decoding began; rerun the same command to start again.',
          status=130, prefix='')
  except BadLogitsError as e:
    _fail(e.message, status=1)
  except JobError as e:
    _fail(e.message)
  except RuntimeError as e:
    message = _required_call_error(e)
    if message is None:
      raise
    _fail(message)


def _fail(message: str, status: int = 2, prefix: str = 'error: ') -> None:
  print(f'speclm.run: {prefix}{message}', file=sys.stderr)
  sys.exit(status)


def _parse_flags(argv: list[str]):
  try:
    argv = rewrite_gin_args(argv)
  except JobError as e:
    _fail(e.message)
  return app.parse_flags_with_usage(argv)


def run_main() -> None:
  app.run(main, flags_parser=_parse_flags)


if __name__ == '__main__':
  run_main()
