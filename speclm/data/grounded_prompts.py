"""Input-grounded training requests built from text that ships with Python itself.

A draft learns to copy only from requests whose replies copy: summarize, rewrite, translate or
answer from a passage. The passages are docstrings (of modules, classes and functions, read
with `ast`, nothing imported) of the Python standard library this process runs on: real prose,
present on every machine, and disjoint from the demo, held-out and public benchmark prompts.
Their text depends on the Python version, so the requests do too; a seed fixes the choice.
"""

from __future__ import annotations

import ast
import glob
import os
import random
import sysconfig

_TASKS = (
    'Summarize the following text in two sentences.\n\n{passage}',
    'Rewrite the following text in plain, simple English.\n\n{passage}',
    'Translate the following text into French.\n\n{passage}',
    'Translate the following text into Spanish.\n\n{passage}',
    'Read the text below and list its three main points.\n\n{passage}',
    'Read the text below, then say what it is for and who would use it.\n\n{passage}',
    'Turn the following text into a short bulleted list.\n\n{passage}',
    'Copy the first sentence of the text below, then explain it in your own words.\n\n'
    '{passage}',
)


def _first_paragraphs(docstring: str, max_chars: int) -> str:
  text = ''
  for paragraph in docstring.split('\n\n'):
    paragraph = ' '.join(paragraph.split())
    if text and len(text) + len(paragraph) + 1 > max_chars:
      break
    text = f'{text}\n{paragraph}' if text else paragraph
  return text


def stdlib_passages(min_chars: int = 200, max_chars: int = 900,
                    root: str | None = None) -> list[str]:
  """The docstrings of the modules, classes and functions under `root` (the standard library
  by default; tests and IDLE left out), each cut to its first paragraphs (at most `max_chars`)
  and kept if at least `min_chars` long; in file order, duplicates dropped."""
  root = root or sysconfig.get_paths()['stdlib']
  passages, seen = [], set()
  for path in sorted(glob.glob(os.path.join(root, '**', '*.py'), recursive=True)):
    if any(part in ('test', 'tests', 'idlelib', 'site-packages') for part in path.split(os.sep)):
      continue
    try:
      with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
      continue
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      text = _first_paragraphs(ast.get_docstring(node) or '', max_chars)
      if min_chars <= len(text) <= max_chars and text not in seen:
        seen.add(text)
        passages.append(text)
  return passages


def grounded_prompts(count: int, seed: int = 0, passages: list[str] | None = None) -> list[str]:
  """Up to `count` distinct requests: a task (summarize, rewrite, translate, list, explain)
  on a passage (`stdlib_passages()` by default), each passage used at most once."""
  passages = list(stdlib_passages() if passages is None else passages)
  rng = random.Random(seed)
  rng.shuffle(passages)
  return [rng.choice(_TASKS).format(passage=passage) for passage in passages[:count]]
