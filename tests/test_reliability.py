"""Broken files and bad arguments, as a new user meets them: each is refused with one line that
names the file (and the tensor or key), never read silently wrong, never a traceback.

One test per case of issue 38 (numbered as there). Broken files are made in tmp_path from small
real ones: a tiny Llama written as a Hugging Face directory by speclm's own writers
(`hf_llama.config_to_hf`, `params_to_hf`) with a word-level `tokenizer.json`, and a GGUF file
written by the `gguf` package. Job-level cases run `python -m speclm.run` and check the exit
status, the one line, and that the output directory is unchanged.
"""

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import speclm
from speclm import outputs
from speclm import tokenizer as tokenizer_lib
from speclm.checkpoints import errors
from speclm.checkpoints import hf_llama
from speclm.checkpoints import llm
from speclm.data import inputs
from speclm.models import llama

tokenizers = pytest.importorskip('tokenizers')
safetensors_numpy = pytest.importorskip('safetensors.numpy')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ['<pad>', '<eos>', '<unk>', '<|user|>', '<|assistant|>', 'hello', 'world', 'the',
         'cat', 'sat']
VOCAB_SIZE = 32
TEMPLATE = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
            '{% if add_generation_prompt %}<|assistant|>{% endif %}')


def _write_hf(directory, *, template=TEMPLATE):
  """A tiny random Llama as a Hugging Face directory: config.json, model.safetensors,
  tokenizer.json and tokenizer_config.json (with `template`)."""
  from tokenizers import models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  model = llama.random_model(vocab_size=VOCAB_SIZE, embed_dim=16, num_layers=1, num_heads=2,
                             num_kv_heads=1, mlp_dim=32, tie_embeddings=False, seed=3)
  config = model.definition.config
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(hf_llama.config_to_hf(config), f)
  weights = {k: np.ascontiguousarray(v) for k, v in
             hf_llama.params_to_hf(model.params, config).items()}
  safetensors_numpy.save_file(weights, os.path.join(directory, 'model.safetensors'))
  tokens = WORDS + [f'w{i}' for i in range(VOCAB_SIZE - len(WORDS))]
  backend = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                                  unk_token='<unk>'))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.add_special_tokens(WORDS[:5])
  backend.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump({'eos_token': '<eos>', 'pad_token': '<pad>', 'chat_template': template}, f)
  return str(directory)


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  return _write_hf(tmp_path_factory.mktemp('hf') / 'tiny')


def _copy(hf_dir, tmp_path) -> str:
  target = tmp_path / 'model'
  shutil.copytree(hf_dir, target)
  return str(target)


def _truncate(path, keep: float = 0.5) -> None:
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(data[:int(len(data) * keep)])


def _one_line(error: BaseException) -> str:
  message = str(error)
  assert '\n' not in message and 'Traceback' not in message, message
  return message


# ----------------------------------------------------------------------------------------------
# 1–3: silently wrong inputs are refused.


def test_1_float_token_ids_are_refused(hf_dir):
  with pytest.raises(ValueError) as info:
    speclm.generate(hf_dir, None, np.array([[1.5, 2.0, 3.0]]), max_new_tokens=2)
  assert _one_line(info.value).startswith('Token ids must be integers, got a float64 array of'
                                          ' shape (1, 3)')
  with pytest.raises(ValueError, match=r'^Token ids must be integers, got a float64 array of'
                     r' shape \(3,\)'):
    speclm.generate(hf_dir, None, np.array([1.5, 2.0, 3.0]), max_new_tokens=2)
  with pytest.raises(ValueError, match=r'^Token ids must be integers, got 2\.5 \(float\)'):
    speclm.generate(hf_dir, None, [[1, 2.5]], max_new_tokens=2)
  # Integer ids still decode (the refusal is about the type, not about arrays).
  assert len(speclm.generate(hf_dir, None, np.array([[5, 6]], np.int32),
                             max_new_tokens=2).texts) == 1


def test_2_null_or_non_string_jsonl_input_names_file_and_line(tmp_path):
  path = tmp_path / 'inputs.jsonl'
  path.write_text('{"input": "fine"}\n{"input": null}\n')
  with pytest.raises(inputs.DataError) as info:
    inputs.read_examples(str(path))
  assert _one_line(info.value) == (f"{path}:2: the 'input' field is null, not a string; every"
                                   ' input must be text.')
  path.write_text('{"input": 7}\n')
  with pytest.raises(inputs.DataError, match=r":1: the 'input' field is a JSON int \(7\)"):
    inputs.read_examples(str(path))


@pytest.mark.parametrize('suffix, line', [('.txt', 'hello world'),
                                          ('.jsonl', '{"input": "hello world"}')])
def test_3_a_utf8_bom_is_not_part_of_the_first_input(tmp_path, suffix, line):
  path = tmp_path / f'inputs{suffix}'
  path.write_bytes(b'\xef\xbb\xbf' + f'{line}\nsecond\n'.encode() if suffix == '.txt'
                   else b'\xef\xbb\xbf' + f'{line}\n'.encode())
  examples = inputs.read_examples(str(path))
  assert examples[0].input == 'hello world'


# ----------------------------------------------------------------------------------------------
# 4–7, 12: broken checkpoint files name the file (and the tensor or key).


def test_4_a_misshapen_tensor_names_the_checkpoint(hf_dir, tmp_path):
  directory = _copy(hf_dir, tmp_path)
  path = os.path.join(directory, 'model.safetensors')
  weights = safetensors_numpy.load_file(path)
  weights['model.layers.0.mlp.up_proj.weight'] = np.zeros((31, 16), np.float32)
  safetensors_numpy.save_file(weights, path)
  with pytest.raises(errors.CheckpointError) as info:
    llm.load_llm(directory)
  assert _one_line(info.value) == (
      f"{directory}: Tensor 'model.layers.0.mlp.up_proj.weight' has shape (31, 16), but"
      ' config.json implies (32, 16); the weights and the config do not belong together.')
  assert info.value.path == directory and info.value.key == 'model.layers.0.mlp.up_proj.weight'


@pytest.mark.parametrize('name', ['config.json', 'tokenizer_config.json'])
def test_5_a_truncated_json_file_is_named(hf_dir, tmp_path, name):
  directory = _copy(hf_dir, tmp_path)
  _truncate(os.path.join(directory, name))
  load = llm.load_llm if name == 'config.json' else llm.load_llm_tokenizer
  with pytest.raises(errors.CheckpointError) as info:
    load(directory)
  path = os.path.join(directory, name)
  assert _one_line(info.value).startswith(f'{path} is not valid JSON (')
  assert 'truncated or corrupt' in str(info.value) and info.value.path == path


def test_6_a_missing_config_key_names_key_and_file(hf_dir, tmp_path):
  directory = _copy(hf_dir, tmp_path)
  path = os.path.join(directory, 'config.json')
  _drop_key(directory)
  for load in (llm.load_llm, llm.read_llm_config):
    with pytest.raises(errors.CheckpointError) as info:
      load(directory)
    assert _one_line(info.value) == (
        f"{path} lacks 'num_hidden_layers', which a llama model needs; the file is incomplete"
        ' (compare it with the original checkpoint).')
    assert info.value.key == 'num_hidden_layers'


def test_7_a_truncated_tokenizer_json_is_named(hf_dir, tmp_path):
  directory = _copy(hf_dir, tmp_path)
  path = os.path.join(directory, 'tokenizer.json')
  _truncate(path)
  with pytest.raises(errors.CheckpointError) as info:
    llm.load_llm_tokenizer(directory)
  assert _one_line(info.value).startswith(f'{path} is not a readable tokenizer.json (')
  assert info.value.path == path
  with pytest.raises(errors.CheckpointError, match='is not a readable tokenizer.json'):
    speclm.generate(directory, None, 'hello', max_new_tokens=2)


def _write_gguf(path):
  gguf = pytest.importorskip('gguf')
  writer = gguf.GGUFWriter(str(path), 'llama')
  writer.add_uint32('llama.block_count', 1)
  writer.add_tensor('token_embd.weight', np.ones((64, 32), np.float32))
  writer.add_tensor('output_norm.weight', np.ones((32,), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_12_gguf_truncation_names_the_tensor_not_numpy(tmp_path):
  from speclm.checkpoints import gguf as gguf_reader  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'm.gguf'
  _write_gguf(path)
  size = os.path.getsize(path)
  _truncate(path, keep=0.5)
  with pytest.raises(errors.CheckpointError) as info:
    gguf_reader.open_gguf(path)
  message = _one_line(info.value)
  assert message.startswith(f"{path} is not a readable GGUF file: tensor 'token_embd.weight'"
                            ' needs bytes ')
  assert f'but the file ends at {size // 2:,}: it is truncated' in message
  assert 'reshape' not in message
  path.write_bytes(path.read_bytes()[:40])  # inside the header (metadata)
  with pytest.raises(errors.CheckpointError, match='ends .* inside its header') as info:
    llm.load_llm(path)
  assert 'out of bounds' not in str(info.value)


# ----------------------------------------------------------------------------------------------
# 13: chat templates are bounded.


@pytest.mark.parametrize('template, reason', [
    ('{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}',
     'ran longer than 0.5 s (a loop without end?)'),
    ("{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
     'wrote over 1,000,000 characters'),
    ("{{ 'x' * 100000000 }}", 'multiplies a sequence to 100,000,000 items'),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     '{% endfor %}{{ ns.s }}', 'built a value of 1,048,576 items'),
    ("{{ ''.__class__.__mro__ }}", 'was stopped by the sandbox'),
])
def test_13_chat_template_rendering_is_bounded(monkeypatch, template, reason):
  monkeypatch.setattr(tokenizer_lib, 'MAX_RENDER_SECONDS', 0.5)
  tok = tokenizer_lib.Tokenizer(None, chat_template=template,
                                chat_template_source='/m/tokenizer_config.json')
  start = time.monotonic()
  with pytest.raises(tokenizer_lib.ChatTemplateError) as info:
    tok.render_chat('hello')
  assert time.monotonic() - start < 5
  assert _one_line(info.value).startswith(
      f'The chat template of /m/tokenizer_config.json {reason}')
  assert info.value.args[0].endswith('fix the template (or pass chat=False / use a plain-text'
                                     ' vocabulary).')


# ----------------------------------------------------------------------------------------------
# 8 and 11: the job ends in one line (exit 2; 143 for SIGTERM), the output directory unchanged.


def _env():
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join([REPO, env.get('PYTHONPATH', '')])
  env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def _job_args(directory, prompts, out):
  return [sys.executable, '-m', 'speclm.run', '--gin_file=runs/checkpoint_llm.gin',
          f"--gin.TARGET_PATH='{directory}'", f"--gin.DRAFT_PATH='{directory}'",
          f"--gin.PROMPTS_PATH='{prompts}'", f"--gin.OUTPUT_DIR='{out}'",
          '--gin.MAX_NEW_TOKENS=2', '--gin.run_job.show_progress=False',
          '--gin.run_job.measure_cost=False', '--gin.run_job.reference_metrics=[]']


def _outputs(out) -> dict[str, bytes]:
  """Every file of the output directory but its lock, with its bytes."""
  if not os.path.isdir(out):
    return {}
  result = {}
  for name in sorted(os.listdir(out)):
    if name != outputs.LOCK:
      with open(os.path.join(out, name), 'rb') as f:
        result[name] = f.read()
  return result


def _error_line(proc) -> str:
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith('speclm.run:')]
  assert len(lines) == 1, proc.stderr[-3000:]
  return lines[0]


def _break_config(directory):
  _truncate(os.path.join(directory, 'config.json'))


def _drop_key(directory):
  path = os.path.join(directory, 'config.json')
  with open(path, encoding='utf-8') as f:
    config = json.load(f)
  del config['num_hidden_layers']
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(config, f)


def _blocked_template(directory):
  path = os.path.join(directory, 'tokenizer_config.json')
  with open(path, encoding='utf-8') as f:
    config = json.load(f)
  config['chat_template'] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(config, f)


def _break_tokenizer(directory):
  _truncate(os.path.join(directory, 'tokenizer.json'))


@pytest.mark.parametrize('damage, line', [
    (_break_tokenizer, 'speclm.run: error: Loading the vocabulary failed: {model}/tokenizer.json'
                       ' is not a readable tokenizer.json ('),
    (_break_config, 'speclm.run: error: Loading the target model failed: {model}/config.json is'
                    ' not valid JSON ('),
    (_drop_key, "speclm.run: error: Loading the target model failed: {model}/config.json lacks"
                " 'num_hidden_layers', which a llama model needs"),
    (_blocked_template, 'speclm.run: error: The chat template of {model}/tokenizer_config.json'
                        " was stopped by the sandbox (access to attribute '__class__' of 'str'"
                        ' object is unsafe.)'),
])
def test_8_broken_checkpoints_end_the_job_in_one_line(hf_dir, tmp_path, damage, line):
  directory = _copy(hf_dir, tmp_path)
  damage(directory)
  prompts = tmp_path / 'prompts.txt'
  prompts.write_text('hello world\n')
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'notes.txt').write_text('keep me')
  before = _outputs(out)
  proc = subprocess.run(_job_args(directory, prompts, out), cwd=tmp_path, env=_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert _error_line(proc).startswith(line.format(model=directory))
  assert _outputs(out) == before
  if damage is _drop_key:  # --verbose adds the traceback, the line stays the same
    verbose = subprocess.run(_job_args(directory, prompts, out) + ['--verbose'], cwd=tmp_path,
                             env=_env(), capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 2 and 'Traceback' in verbose.stderr
    assert verbose.stderr.rstrip().splitlines()[-1] == _error_line(proc)


def _lines(path) -> int:
  try:
    with open(path, 'rb') as f:
      return f.read().count(b'\n')
  except FileNotFoundError:
    return 0


def test_11_sigterm_stops_like_ctrl_c_with_exit_143(tmp_path):
  out = tmp_path / 'out'
  proc = subprocess.Popen(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin',
       '--gin.run_job.show_progress=False', '--gin.run_job.measure_cost=False',
       f"--gin.OUTPUT_DIR='{out}'", '--gin.synthetic_dataset.num_examples=400',
       '--gin.BATCH_SIZE=1'],
      cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  while _lines(out / outputs.PREDICTIONS) < 2 and time.monotonic() < deadline:
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 143, stderr[-3000:]
  lines = [line for line in stderr.splitlines() if line.startswith('speclm.run:')]
  assert 'Traceback' not in stderr and len(lines) == 1, stderr[-3000:]
  recorded = _lines(out / outputs.PREDICTIONS)
  assert lines[0].startswith('speclm.run: terminated (SIGTERM) after ')
  assert f'({recorded} of 400 recorded in {out}); rerun the same command to resume.' in lines[0]
  # Every record written before the signal is whole (a resume reads them all).
  assert len(outputs.read_predictions(str(out / outputs.PREDICTIONS))) == recorded


# ----------------------------------------------------------------------------------------------
# The job layer lets no exception through without the one-line treatment.
#
# What counts: in speclm/run/, a handler (`except …:`) whose body re-raises what it caught (a
# bare `raise`, or `raise NAME` of the caught name) hands that exception on unchanged. That is
# allowed in every module but cli.py, because cli.main's catch-all turns it into one line; in
# cli.py such a handler is the leak itself (the exception would reach absl as a traceback).
# And what absl calls, cli.main and cli._parse_flags (which runs before main), must each end
# in that catch-all: a `try` with an `except Exception` (or BaseException) whose body calls
# `_fail`, and no statement after it. In every module of speclm/run/, a handler that catches
# interrupts (a bare `except:`, BaseException, KeyboardInterrupt) must end in a `raise` or
# `_fail`: swallowing one would turn Ctrl-C or SIGTERM into a silent exit 0 mid-job.

ENTRY_POINTS = ('main', '_parse_flags')


def _reraises(handler: ast.ExceptHandler) -> bool:
  for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
    if isinstance(node, ast.Raise):
      if node.exc is None:
        return True
      if handler.name and isinstance(node.exc, ast.Name) and node.exc.id == handler.name:
        return True
  return False


def _catches_everything(handler: ast.ExceptHandler) -> bool:
  return isinstance(handler.type, ast.Name) and handler.type.id in ('Exception', 'BaseException')


def _calls_fail(handler: ast.ExceptHandler) -> bool:
  return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == '_fail'
             for n in ast.walk(ast.Module(body=handler.body, type_ignores=[])))


def _catches_interrupts(handler: ast.ExceptHandler) -> bool:
  if handler.type is None:
    return True
  types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
  return any(isinstance(t, ast.Name) and t.id in ('BaseException', 'KeyboardInterrupt')
             for t in types)


def _ends_in_raise_or_fail(handler: ast.ExceptHandler) -> bool:
  last = handler.body[-1]
  return isinstance(last, ast.Raise) or (
      isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
      and isinstance(last.value.func, ast.Name) and last.value.func.id == '_fail')


def leaks(run_dir: str) -> list[str]:
  """The places in the job layer where an exception can escape without its one line, or an
  interrupt is swallowed."""
  problems = []
  for name in sorted(os.listdir(run_dir)):
    if not name.endswith('.py'):
      continue
    with open(os.path.join(run_dir, name), encoding='utf-8') as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if (isinstance(node, ast.ExceptHandler) and _catches_interrupts(node)
          and not _ends_in_raise_or_fail(node)):
        problems.append(f'{name}:{node.lineno}: the handler swallows Ctrl-C / SIGTERM')
  with open(os.path.join(run_dir, 'cli.py'), encoding='utf-8') as f:
    cli_tree = ast.parse(f.read())
  for node in ast.walk(cli_tree):
    if isinstance(node, ast.ExceptHandler) and _reraises(node):
      problems.append(f'cli.py:{node.lineno}: the handler re-raises what it caught')
  for name in ENTRY_POINTS:
    function = next(n for n in cli_tree.body
                    if isinstance(n, ast.FunctionDef) and n.name == name)
    guarded = [s for s in function.body if isinstance(s, ast.Try) and any(
        _catches_everything(h) and _calls_fail(h) for h in s.handlers)]
    if not guarded:
      problems.append(f'cli.py: {name} has no `except Exception` that ends in _fail')
    else:
      last = function.body.index(guarded[-1])
      for statement in function.body[last + 1:]:
        problems.append(f'cli.py:{statement.lineno}: a statement of {name} after its catch-all')
  return problems


def test_no_exception_leaves_the_job_layer_without_one_line(tmp_path):
  run_dir = os.path.join(REPO, 'speclm', 'run')
  assert leaks(run_dir) == []
  # The check fails on a copy with a handler that re-raises, and on one without the catch-all.
  scratch = tmp_path / 'run'
  shutil.copytree(run_dir, scratch)
  with open(scratch / 'cli.py', encoding='utf-8') as f:
    source = f.read()
  leaky = source + textwrap.dedent('''
      def _leaky():
        try:
          _run()
        except OSError:
          raise
      ''')
  (scratch / 'cli.py').write_text(leaky)
  assert any('the handler re-raises what it caught' in p for p in leaks(str(scratch)))
  (scratch / 'cli.py').write_text(source)
  job_source = (scratch / 'job.py').read_text(encoding='utf-8')
  swallowing = job_source + textwrap.dedent('''
      def _swallow():
        try:
          run_job()
        except KeyboardInterrupt:
          pass
      ''')
  (scratch / 'job.py').write_text(swallowing, encoding='utf-8')
  handler_line = len(swallowing.splitlines()) - 1
  assert leaks(str(scratch)) == [f'job.py:{handler_line}: the handler swallows Ctrl-C / SIGTERM']
  (scratch / 'job.py').write_text(job_source, encoding='utf-8')
  unguarded = source.replace('except Exception as e:', 'except ImportError as e:')
  assert unguarded != source
  (scratch / 'cli.py').write_text(unguarded)
  assert leaks(str(scratch)) == [f'cli.py: {name} has no `except Exception` that ends in _fail'
                                 for name in ENTRY_POINTS]
