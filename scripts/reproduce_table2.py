r"""Reproduces Table 2 of Leviathan et al. (2023): tasks × drafts × temperatures, paper beside
ours.

Each row is one `speclm.run` job in 'compare' mode (speculative and baseline on the same
inputs), configured by the task file `configs/{task}_{draft}.gin` at the paper's γ. The script
writes, under --output_dir, one job directory per row plus `table2.md` and `table2.csv` with the
paper's α and walltime speedup next to ours, Theorem 3.8's prediction from our measured α and
c, tokens per target call, identical-output rate and BLEU/ROUGE.

Real run (T5 1.1 checkpoints fine-tuned on each task; `{size}` is xxl/small/base/large and
`{task}` ende/cnndm):

  python scripts/reproduce_table2.py --output_dir=/tmp/table2 \
      --checkpoint_pattern='gs://my-bucket/t5_1_1_{size}_{task}/checkpoint_1000000' \
      --gin.MAX_EXAMPLES=500

Smoke run (a few minutes on a laptop CPU): the same task files, the same job path, with only
these overrides: T5 1.1 scaled down by gin bindings of the models' scopes (float32 on CPU), T5X
checkpoints written here in T5X's own layout (random weights; each draft is the target's first
decoder layers, so α grows with the draft as in the paper), a SentencePiece vocabulary trained
here on local text, and small local EnDe (TSV) and CNN/DM (JSONL) files as the dataset. It
prints the table, then scripts/tpu/run_on_tpu.py's --dry-run of the task files on a v4-8 and a
v4-32 (the commands a TPU user launches). Every row's configuration is parsed before the first
row decodes, so a broken binding stops the run at once, naming the task file:

  python scripts/reproduce_table2.py --smoke --output_dir=/tmp/table2_smoke [--smoke_size=tiny]

--gin_search_paths puts other directories of gin files before configs/ (e.g. edited copies).
Rows already finished in --output_dir are not decoded again (the jobs resume); --report_only
rebuilds the tables from the job directories without running anything (e.g. after copying
results back from a TPU VM).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import sys
from typing import Any, NamedTuple, Sequence

if importlib.util.find_spec('speclm') is None:  # running from a checkout without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top

from speclm import run  # pylint: disable=g-import-not-at-top
from speclm import trees  # pylint: disable=g-import-not-at-top
from speclm.analysis import theory  # pylint: disable=g-import-not-at-top
from speclm.checkpoints import t5x  # pylint: disable=g-import-not-at-top
from speclm.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
from speclm.models import t5  # pylint: disable=g-import-not-at-top
from speclm.run import gin_cli  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ('ende', 'cnndm')
DRAFTS = ('small', 'base', 'large')
TEMPERATURES = (0.0, 1.0)
TASK_NAMES = {'ende': 'EnDe', 'cnndm': 'CNNDM'}
TASK_PREFIXES = {'ende': 'translate English to German: ', 'cnndm': 'summarize: '}
TASK_METRICS = {'ende': 'bleu', 'cnndm': 'rougeLsum'}  # the column shown in the table

# Table 2 of the paper: (task, draft, temperature) -> (γ, α, walltime speedup).
PAPER = theory.PAPER_TABLE2
TARGET_SIZE = 'xxl'  # the paper's target, T5 1.1 XXL; the drafts are DRAFTS
# Where a TPU user's checkpoints would be (the dry-run's placeholder without a pattern).
EXAMPLE_PATTERN = 'gs://YOUR_BUCKET/t5_1_1_{size}_{task}/checkpoint_1000000'
TPU_ACCELERATORS = ('v4-8', 'v4-32')


# ----------------------------------------------------------------------------------------------
# The smoke run's local stand-ins: T5X checkpoints, a SentencePiece vocabulary, two datasets


class SmokeSize(NamedTuple):
  """How far the smoke scales the T5 1.1 gin files down (gin bindings of their scopes only).

  Every model keeps its file's architecture (gated-GELU MLP, untied logits, relative position
  buckets) at one width D, so a draft can be the target's first layers: `draft_layers` of
  the target's `target_layers`, in both stacks.

  Attributes:
    emb_dim, num_heads, head_dim, mlp_dim: D, N, H and F of every model.
    target_layers: decoder depth of the XXL stand-in.
    draft_layers: decoder depth of each draft ('small', 'base', 'large').
    encoder_layers: the most encoder layers of any model (the encoder runs once per input;
      fewer layers compile faster).
    vocab_pieces: pieces of the SentencePiece model trained on local text.
    vocab_size: V, embedding rows (the pieces padded up, as T5 pads 32100 pieces to 32128).
    examples: examples per task (MAX_EXAMPLES).
    new_tokens: MAX_NEW_TOKENS.
  """
  emb_dim: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  target_layers: int
  draft_layers: tuple[tuple[str, int], ...]
  vocab_pieces: int
  vocab_size: int
  examples: int
  new_tokens: int
  encoder_layers: int = 1 << 10

  def layers(self, size: str) -> tuple[int, int]:
    """(encoder, decoder) depth of the model `size` ('xxl' or a draft)."""
    depth = self.target_layers if size == TARGET_SIZE else dict(self.draft_layers)[size]
    return min(depth, self.encoder_layers), depth


_DRAFT_LAYERS = (('small', 1), ('base', 2), ('large', 3))
SMOKE_SIZES = {
    # The test's: every task file in about a minute of CPU.
    'tiny': SmokeSize(emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32, target_layers=4,
                      draft_layers=_DRAFT_LAYERS, vocab_pieces=200, vocab_size=256,
                      examples=4, new_tokens=8, encoder_layers=1),
    'small': SmokeSize(emb_dim=64, num_heads=4, head_dim=16, mlp_dim=128, target_layers=4,
                       draft_layers=_DRAFT_LAYERS, vocab_pieces=400, vocab_size=512,
                       examples=8, new_tokens=16),
}

# EnDe-shaped examples: (English input, German reference), written for the smoke.
ENDE_PAIRS = (
    ('The small house stands at the end of the street.',
     'Das kleine Haus steht am Ende der Straße.'),
    ('We read the letter twice before we answered it.',
     'Wir lasen den Brief zweimal, bevor wir ihn beantworteten.'),
    ('The train to Berlin leaves every morning at seven.',
     'Der Zug nach Berlin fährt jeden Morgen um sieben ab.'),
    ('My sister works in a library near the river.',
     'Meine Schwester arbeitet in einer Bibliothek am Fluss.'),
    ('The children played in the garden until dark.',
     'Die Kinder spielten im Garten, bis es dunkel wurde.'),
    ('This report describes the results of the first year.',
     'Dieser Bericht beschreibt die Ergebnisse des ersten Jahres.'),
    ('The weather will be cold and windy tomorrow.',
     'Das Wetter wird morgen kalt und windig sein.'),
    ('He opened the window because the room was warm.',
     'Er öffnete das Fenster, weil das Zimmer warm war.'),
)
# CNN/DM-shaped examples come from these modules' docstrings (article: the text; highlight:
# its summary line); the vocabulary is trained on them and their members' docstrings.
DOC_MODULES = ('json', 'csv', 'argparse', 'subprocess', 'unittest', 'heapq', 'sched', 'uuid',
               'difflib', 'fnmatch', 'pickle', 'string', 'random', 'calendar')


def _docstring_corpus() -> list[tuple[str, str]]:
  """(summary line, prose) of each module in DOC_MODULES with a long enough docstring."""
  out = []
  for name in DOC_MODULES:
    doc = inspect.getdoc(importlib.import_module(name)) or ''
    summary = doc.partition('\n')[0]
    prose = ' '.join(' '.join(doc.split()).split(' ')[:80])
    if summary.strip() and len(prose) >= 120:
      out.append((summary.strip(), prose))
  return out


def _training_text() -> list[str]:
  """Lines to train the vocabulary on: the examples and the modules' member docstrings."""
  lines = [text for pair in ENDE_PAIRS for text in pair]
  lines += [TASK_PREFIXES[task] for task in TASKS]
  for name in DOC_MODULES:
    module = importlib.import_module(name)
    for obj in [module] + [member for _, member in inspect.getmembers(module)]:
      doc = inspect.getdoc(obj) if callable(obj) or obj is module else None
      lines += [line.strip() for line in (doc or '').splitlines() if line.strip()]
  return lines


def train_vocabulary(path: str, pieces: int) -> str:
  """Trains a SentencePiece model with T5's special ids (pad 0, end 1, unknown 2) on local
  text and writes it to `path`."""
  import sentencepiece  # pylint: disable=g-import-not-at-top
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(_training_text()), model_writer=model, vocab_size=pieces,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, minloglevel=2)
  with open(path, 'wb') as f:
    f.write(model.getvalue())
  return path


def _encoded_length(vocabulary, task: str, text: str) -> int:
  """Encoder tokens of a task's input as the job encodes it (prefix, text, end token)."""
  return len(vocabulary.encode(TASK_PREFIXES[task] + text)) + 1


def _fit(vocabulary, task: str, text: str, limit: int) -> str:
  """`text` less its last words until the encoded input is at most `limit` tokens."""
  words = text.split()
  while len(words) > 1 and _encoded_length(vocabulary, task, ' '.join(words)) > limit:
    words.pop()
  return ' '.join(words)


def write_datasets(directory: str, examples: int, vocabulary_path: str) -> dict[str, str]:
  """EnDe (TSV: input, reference) and CNN/DM (JSONL) files of `examples` rows; task -> path.

  The articles are cut so that every input of both tasks fits the length bucket (a power of
  two) of the longest EnDe input: one input shape, so each program compiles once.
  """
  articles = _docstring_corpus()
  if len(articles) < examples or len(ENDE_PAIRS) < examples:
    raise SystemExit(f'reproduce_table2: the smoke has {min(len(articles), len(ENDE_PAIRS))}'
                     f' examples per task, not {examples}.')
  vocabulary = vocab_lib.SentencePieceVocabulary(vocabulary_path)
  pairs = ENDE_PAIRS[:examples]
  longest = max(_encoded_length(vocabulary, 'ende', english) for english, _ in pairs)
  bucket = 1 << (longest - 1).bit_length()
  paths = {'ende': os.path.join(directory, 'ende.tsv'),
           'cnndm': os.path.join(directory, 'cnndm.jsonl')}
  with open(paths['ende'], 'w', encoding='utf-8') as f:
    f.writelines(f'{english}\t{german}\n' for english, german in pairs)
  with open(paths['cnndm'], 'w', encoding='utf-8') as f:
    for number, (summary, prose) in enumerate(articles[:examples]):
      article = _fit(vocabulary, 'cnndm', prose, bucket)
      f.write(json.dumps({'id': f'cnndm-{number}', 'input': article, 'reference': summary})
              + '\n')
  return paths


def size_bindings(size: SmokeSize, model: str) -> list[str]:
  """Gin bindings scaling configs/models/t5_1_1/{model}.gin down to `size` (its scope only)."""
  encoder_layers, decoder_layers = size.layers(model)
  values = {'vocab_size': size.vocab_size, 'emb_dim': size.emb_dim,
            'num_heads': size.num_heads, 'head_dim': size.head_dim, 'mlp_dim': size.mlp_dim,
            'num_encoder_layers': encoder_layers, 'num_decoder_layers': decoder_layers}
  return [f't5_1_1_{model}/T5Config.{key} = {value}' for key, value in values.items()]


def smoke_config(size: SmokeSize, model: str,
                 search_paths: Sequence[str] = ()) -> t5.T5Config:
  """The float32 `T5Config` that configs/models/t5_1_1/{model}.gin gives with size_bindings."""
  name = os.path.join('models', 't5_1_1', f'{model}.gin')
  path = next(os.path.join(d, name) for d in gin_cli.search_paths(search_paths)
              if os.path.isfile(os.path.join(d, name)))
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([path], size_bindings(size, model),
                                        finalize_config=False)
    with gin.config_scope(f't5_1_1_{model}'):
      config = run.providers.T5Config()
  finally:
    gin.clear_config()
  return dataclasses.replace(config, dtype='float32', param_dtype='float32')


_LAYER = re.compile(r'^(encoder|decoder)/layers_([0-9]+)/')


def first_layers(params: dict, encoder_layers: int, decoder_layers: int) -> dict:
  """The parameters of a T5 restricted to its first encoder and decoder layers (embedding,
  norms, relative position biases and logits shared)."""
  depth = {'encoder': encoder_layers, 'decoder': decoder_layers}
  kept = {name: value for name, value in trees.flatten(params).items()
          if not (m := _LAYER.match(name)) or int(m.group(2)) < depth[m.group(1)]}
  return trees.unflatten(kept)


# The embedding and the output layer (and their optimizer slots) go to zarr, as T5X writes
# large arrays; the rest stays inline in the msgpack (fewer files to write).
SMOKE_ZARR_MIN_BYTES = 8 << 10
# Layer i's residual branches (attention and MLP outputs) are scaled by LAYER_FADE ** i.
LAYER_FADE = 0.5
_BRANCH_OUTPUTS = ('attention/out/kernel', 'mlp/wo/kernel')


def fade_layers(params: dict, fade: float = LAYER_FADE) -> dict:
  """Random T5 parameters whose later layers change the residual stream less: layer i's
  attention and MLP output kernels scaled by `fade ** i`, so the model made of the first k
  layers approaches the whole one as k grows (as the paper's larger drafts approach T5-XXL)."""
  out = {}
  for name, value in trees.flatten(params).items():
    m = _LAYER.match(name)
    if m and name.endswith(_BRANCH_OUTPUTS):
      value = value * fade ** int(m.group(2))
    out[name] = value
  return trees.unflatten(out)


def write_checkpoints(directory: str, size: SmokeSize,
                      search_paths: Sequence[str] = ()) -> str:
  """Random T5X checkpoints of every model, per task; returns their --checkpoint_pattern.

  The target of each task has its own random weights (seeded by the task); each draft is the
  target's first layers, so α grows with the draft's depth, as with the paper's drafts.
  """
  pattern = os.path.join(directory, 't5_1_1_{size}_{task}', 'checkpoint_0')
  configs = {model: smoke_config(size, model, search_paths)
             for model in (TARGET_SIZE, *DRAFTS)}
  for seed, task in enumerate(TASKS):
    params = fade_layers(t5.T5(configs[TARGET_SIZE]).init_params(jax.random.key(seed)))
    for model, config in configs.items():
      model_params = first_layers(params, config.num_encoder_layers,
                                  config.num_decoder_layers)
      _check_fits(model_params, t5.T5(config).param_shapes(), model)
      t5x.save_t5x_train_state(pattern.format(size=model, task=task), model_params,
                               zarr_min_bytes=SMOKE_ZARR_MIN_BYTES)
  return pattern


def _check_fits(params: dict, expected: dict, model: str) -> None:
  """Stops unless `params` has exactly the names and shapes of `expected` (a model's)."""
  got = {k: tuple(v.shape) for k, v in trees.flatten(params).items()}
  want = {k: tuple(v.shape) for k, v in trees.flatten(expected).items()}
  if got != want:
    raise SystemExit(f'reproduce_table2: the smoke\'s {model} is not the target\'s first layers'
                     f' (different width?): {sorted(set(got.items()) ^ set(want.items()))[:3]}')


def build_smoke(directory: str, size: SmokeSize, search_paths: Sequence[str] = ()) -> dict:
  """Writes the smoke's vocabulary, datasets and checkpoints under `directory`.

  Returns:
    {'vocabulary': path, 'datasets': {task: path}, 'pattern': checkpoint pattern}.
  """
  for sub in ('data', 'checkpoints'):
    os.makedirs(os.path.join(directory, sub), exist_ok=True)
  vocabulary = train_vocabulary(os.path.join(directory, 'data', 'spm.model'),
                                size.vocab_pieces)
  return {'vocabulary': vocabulary,
          'datasets': write_datasets(os.path.join(directory, 'data'), size.examples, vocabulary),
          'pattern': write_checkpoints(os.path.join(directory, 'checkpoints'), size,
                                       search_paths)}


def smoke_bindings(task: str, draft: str, size: SmokeSize, assets: dict) -> list[str]:
  """A smoke row's overrides of its task file: model sizes (float32 on CPU), the vocabulary
  and the local dataset. Checkpoint paths come from the assets' pattern."""
  return [
      *size_bindings(size, TARGET_SIZE), *size_bindings(size, draft),
      "TARGET_DTYPE = 'float32'", "DRAFT_DTYPE = 'float32'",
      f"VOCABULARY_PATH = '{assets['vocabulary']}'",
      'DATASET = @file_dataset', f"file_dataset.path = '{assets['datasets'][task]}'",
      f"file_dataset.input_prefix = '{TASK_PREFIXES[task]}'",
      f'MAX_EXAMPLES = {size.examples}', f'MAX_NEW_TOKENS = {size.new_tokens}',
  ]


# ----------------------------------------------------------------------------------------------
# Rows


def row_dir(output_dir: str, task: str, draft: str, temperature: float) -> str:
  """The job directory of one row, e.g. OUTPUT/ende_small_t0."""
  return os.path.join(output_dir, f'{task}_{draft}_t{temperature:g}')


def job_bindings(task: str, draft: str, temperature: float, *, output_dir: str,
                 checkpoint_pattern: str | None,
                 extra: Sequence[str]) -> tuple[list[str], list[str]]:
  """(gin files, bindings) of one row's job: its task file, the temperature, the output
  directory, the checkpoints of `checkpoint_pattern` (if given) and `extra`."""
  bindings = [f"OUTPUT_DIR = '{output_dir}'", f'TEMPERATURE = {temperature}']
  if checkpoint_pattern:
    bindings += [
        f"TARGET_CHECKPOINT = '{checkpoint_pattern.format(size=TARGET_SIZE, task=task)}'",
        f"DRAFT_CHECKPOINT = '{checkpoint_pattern.format(size=draft, task=task)}'"]
  return [f'{task}_{draft}.gin'], bindings + list(extra)


def run_row(files: Sequence[str], bindings: Sequence[str],
            search_paths: Sequence[str] = ()) -> dict[str, Any]:
  """Runs one row's job (`speclm.run.run_job`) in this process; returns its metrics."""
  gin.clear_config()
  try:
    run.parse_gin(files, bindings, search_paths)
    return run.run_job(show_progress=False)  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


def check_row(files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str] = ()) -> None:
  """Parses one row's configuration and checks its local checkpoint paths, decoding nothing.

  Raises:
    run.JobError: the files or bindings do not configure a job (the gin error's first line).
  """
  gin.clear_config()
  try:
    run.parse_gin(files, bindings, search_paths)
    gin_cli.check_model_paths()
  except ValueError as e:  # gin's own errors (e.g. an undefined macro) carry the whole config
    raise run.JobError(str(e).split('\n', 1)[0].removesuffix(' in config string:')) from None
  finally:
    gin.clear_config()


def _load_metrics(directory: str) -> dict[str, Any] | None:
  path = os.path.join(directory, 'metrics.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


COLUMNS = ['task', 'draft', 'temperature', 'gamma', 'paper_alpha', 'alpha', 'paper_speedup',
           'speedup', 'theorem_3_8_speedup', 'c', 'tokens_per_target_call',
           'identical_output_rate', 'quality_metric', 'quality', 'examples']


def table_rows(output_dir: str, rows: Sequence[tuple[str, str, float]]) -> list[dict[str, Any]]:
  """One dict of COLUMNS per (task, draft, temperature): the paper's figures and the row's
  metrics.json (None where the row has not run)."""
  out = []
  for task, draft, temperature in rows:
    gamma, paper_alpha, paper_speedup = PAPER[(task, draft, temperature)]
    metrics = _load_metrics(row_dir(output_dir, task, draft, temperature)) or {}
    quality_key = TASK_METRICS[task]
    out.append({
        'task': TASK_NAMES[task], 'draft': f'T5-{draft.upper()}', 'temperature': temperature,
        'gamma': metrics.get('gamma', gamma), 'paper_alpha': paper_alpha,
        'alpha': metrics.get('alpha'), 'paper_speedup': paper_speedup,
        'speedup': metrics.get('speedup'),
        'theorem_3_8_speedup': metrics.get('predicted_speedup_theorem_3_8'),
        'c': metrics.get('c'), 'tokens_per_target_call': metrics.get('tokens_per_target_call'),
        'identical_output_rate': metrics.get('identical_output_rate'),
        'quality_metric': quality_key,
        'quality': (metrics.get('speculative') or {}).get(quality_key),
        'examples': metrics.get('num_decoded'),
    })
  return out


def _f(value, digits: int = 2, suffix: str = '') -> str:
  if value is None:
    return '–'
  return f'{value:.{digits}f}{suffix}'


def _smoke_note(size: SmokeSize | None) -> str:
  """The table's note on what a smoke run at `size` is (None: --report_only without a size)."""
  if size is None:
    return 'Smoke run: only the shape of the table is meaningful.'
  drafts = '/'.join(str(size.layers(d)[1]) for d in DRAFTS)
  return (f'Smoke run: the task files themselves with T5 1.1 scaled down by gin bindings (D ='
          f' {size.emb_dim}, F = {size.mlp_dim}, {size.num_heads} heads, V = {size.vocab_size};'
          f' XXL {size.target_layers} decoder layers, SMALL/BASE/LARGE {drafts}: the target\'s'
          f' first layers; encoders of at most {size.layers(TARGET_SIZE)[0]}), random T5X'
          ' checkpoints, a SentencePiece vocabulary trained on local text and local EnDe/CNN-DM-shaped inputs, so only the path, α\'s growth with the'
          ' draft and greedy exactness are meaningful, not the numbers.')


def to_markdown(rows: Sequence[dict[str, Any]], *, smoke: bool,
                size: SmokeSize | None = None) -> str:
  """Table 2 as markdown: the paper's α and speedup beside ours (`size`: the smoke's)."""
  lines = [
      '# Table 2: T5-XXL target, walltime speedup of speculative decoding',
      '',
      (_smoke_note(size) if smoke else
       'Paper: one TPU-v4, batch size 1. Ours: this machine and the jobs\' settings.'),
      '',
      '| Task | M_q | Temp | γ | α paper | α ours | Speedup paper | Speedup ours |'
      ' Thm 3.8 (ours) | c ours | Tokens/call | Identical | Quality |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    quality = '–' if r['quality'] is None else f"{r['quality_metric']} {r['quality']:.1f}"
    lines.append(
        f"| {r['task']} | {r['draft']} | {r['temperature']:g} | {r['gamma']} |"
        f" {r['paper_alpha']:.2f} | {_f(r['alpha'])} | {r['paper_speedup']:.1f}X |"
        f" {_f(r['speedup'], 2, 'X')} | {_f(r['theorem_3_8_speedup'], 2, 'X')} |"
        f" {_f(r['c'], 3)} | {_f(r['tokens_per_target_call'])} |"
        f" {_f(r['identical_output_rate'] and 100 * r['identical_output_rate'], 0, '%')} |"
        f" {quality} |")
  return '\n'.join(lines) + '\n'


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
  """The table's rows as CSV text (empty cells where a row has no value)."""
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator='\n')
  writer.writeheader()
  for r in rows:
    writer.writerow({k: ('' if r[k] is None else r[k]) for k in COLUMNS})
  return buffer.getvalue()


def _split(values: str, allowed: Sequence[Any], cast=str) -> list[Any]:
  chosen = [cast(v) for v in values.split(',') if v]
  for value in chosen:
    if value not in allowed:
      raise SystemExit(f'reproduce_table2: {value!r} is not one of {list(allowed)}.')
  return chosen


def _load_tpu_script():
  """scripts/tpu/run_on_tpu.py as a module (its `main` prints the dry-run)."""
  path = os.path.join(REPO, 'scripts', 'tpu', 'run_on_tpu.py')
  spec = importlib.util.spec_from_file_location('run_on_tpu', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tpu_dry_runs(task_files: Sequence[tuple[str, str]], pattern: str | None,
                 accelerators: Sequence[str] = TPU_ACCELERATORS) -> str:
  """scripts/tpu/run_on_tpu.py --dry-run for each accelerator and (task, draft) task file.

  The first task file's dry-run is shown whole; the others' differ only in the job's command
  line, which is shown alone.
  """
  tpu = _load_tpu_script()
  pattern = pattern or EXAMPLE_PATTERN
  out = []
  for accelerator in accelerators:
    out.append(f'## scripts/tpu/run_on_tpu.py --accelerator_type={accelerator} --dry-run')
    for number, (task, draft) in enumerate(task_files):
      args = ['--name=speclm-table2', '--zone=us-central2-b',
              f'--accelerator_type={accelerator}', f'--gin_file={task}_{draft}.gin',
              f"--gin.TARGET_CHECKPOINT='{pattern.format(size=TARGET_SIZE, task=task)}'",
              f"--gin.DRAFT_CHECKPOINT='{pattern.format(size=draft, task=task)}'", '--dry-run']
      stdout, stderr = io.StringIO(), io.StringIO()
      with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = tpu.main(args)
      if status != 0:
        raise SystemExit(f'reproduce_table2: run_on_tpu.py {" ".join(args)} failed:'
                         f' {stderr.getvalue()}')
      lines = stderr.getvalue().splitlines() + stdout.getvalue().splitlines()
      if number == 0:
        out += lines
      else:
        out += [f'# run job ({task}_{draft}.gin)', lines[lines.index('# run job') + 1]]
    out.append('')
  return '\n'.join(out)


def _arguments(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
  """The script's flags and the --gin.NAME=VALUE bindings passed on to every job."""
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      epilog='Any --gin.NAME=VALUE argument is passed on to every job.',
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--output_dir', required=True, help='one job directory per row + tables')
  parser.add_argument('--smoke', action='store_true',
                      help='the task files on tiny local T5X checkpoints, minutes on CPU')
  parser.add_argument('--smoke_size', default='small', choices=sorted(SMOKE_SIZES),
                      help="the smoke's model sizes ('tiny': the test's)")
  parser.add_argument('--tasks', default=','.join(TASKS), help='comma-separated: ende,cnndm')
  parser.add_argument('--drafts', default=','.join(DRAFTS), help='comma-separated: small,...')
  parser.add_argument('--temperatures', default='0,1', help='comma-separated: 0,1')
  parser.add_argument('--checkpoint_pattern', default=None,
                      help="e.g. 'gs://bucket/t5_1_1_{size}_{task}/checkpoint_1000000'")
  parser.add_argument('--gin_search_paths', default='',
                      help='comma-separated directories searched for gin files before configs/')
  parser.add_argument('--report_only', action='store_true',
                      help='only rebuild table2.md/.csv from existing job directories')
  args, rest = parser.parse_known_args(argv)
  try:
    extra = [b.split('=', 1)[1] for b in run.rewrite_gin_args(rest)
             if b.startswith('--gin_bindings=')]
  except run.JobError as e:
    raise SystemExit(f'reproduce_table2: {e.message}') from None
  unknown = [a for a in rest if not a.startswith('--gin.')]
  if unknown:
    parser.error(f'unrecognized arguments: {" ".join(unknown)}')
  if not args.smoke and not args.report_only and not args.checkpoint_pattern and not any(
      'CHECKPOINT' in b for b in extra):
    parser.error('real runs need checkpoints: pass --checkpoint_pattern (or --smoke).')
  return args, extra


def _row_jobs(args: argparse.Namespace, rows, extra: Sequence[str],
              search_paths: Sequence[str]) -> list[tuple[str, list[str], list[str]]]:
  """(job directory, gin files, bindings) of each row; for a smoke, builds its local files."""
  pattern, smoke_extra = args.checkpoint_pattern, {}
  if args.smoke:
    size = SMOKE_SIZES[args.smoke_size]
    assets = build_smoke(os.path.join(args.output_dir, 'smoke_files'), size, search_paths)
    pattern = assets['pattern']
    smoke_extra = {(t, d): smoke_bindings(t, d, size, assets) for t, d, _ in rows}
  jobs = []
  for task, draft, temperature in rows:
    directory = row_dir(args.output_dir, task, draft, temperature)
    files, bindings = job_bindings(
        task, draft, temperature, output_dir=directory, checkpoint_pattern=pattern,
        extra=[*smoke_extra.get((task, draft), []), *extra])
    jobs.append((directory, files, bindings))
  return jobs


def _run_rows(rows, jobs, search_paths: Sequence[str]) -> int:
  """Checks every row's configuration, then runs the rows; 0, or 2 naming the failing row."""
  for stage in ('check', 'run'):
    for number, ((task, draft, temperature), (directory, files, bindings)) in enumerate(
        zip(rows, jobs), start=1):
      if stage == 'run':
        print(f'[{number}/{len(rows)}] {files[0]} temperature {temperature:g} -> {directory}',
              flush=True)
      try:
        (check_row if stage == 'check' else run_row)(files, bindings, search_paths)
      except run.JobError as e:
        print(f'reproduce_table2: {files[0]} (row {task} {draft} temperature {temperature:g})'
              f' {"does not configure a job" if stage == "check" else "failed"}: {e.message}',
              file=sys.stderr)
        return 2
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the selected rows (unless --report_only) and writes table2.md and table2.csv."""
  args, extra = _arguments(argv)
  rows = [(task, draft, temperature)
          for task in _split(args.tasks, TASKS)
          for draft in _split(args.drafts, DRAFTS)
          for temperature in _split(args.temperatures, TEMPERATURES, float)]
  search_paths = [p for p in args.gin_search_paths.split(',') if p]
  os.makedirs(args.output_dir, exist_ok=True)
  if not args.report_only:
    status = _run_rows(rows, _row_jobs(args, rows, extra, search_paths), search_paths)
    if status:
      return status
  table = table_rows(args.output_dir, rows)
  markdown = to_markdown(table, smoke=args.smoke,
                         size=SMOKE_SIZES[args.smoke_size] if args.smoke else None)
  with open(os.path.join(args.output_dir, 'table2.md'), 'w', encoding='utf-8') as f:
    f.write(markdown)
  with open(os.path.join(args.output_dir, 'table2.csv'), 'w', encoding='utf-8') as f:
    f.write(to_csv(table))
  print(markdown)
  if args.smoke:
    commands = tpu_dry_runs(list(dict.fromkeys((t, d) for t, d, _ in rows)),
                            args.checkpoint_pattern)
    with open(os.path.join(args.output_dir, 'tpu_commands.txt'), 'w', encoding='utf-8') as f:
      f.write(commands)
    print(commands)
  return 0


if __name__ == '__main__':
  sys.exit(main())
