"""The tqdm progress bar: log lines on a non-terminal stream, nothing when disabled, resumes."""

import io
import re

import tqdm.std

from speclm import progress


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def _lines(stream):
  return stream.getvalue().splitlines()


def test_log_lines_show_label_counts_rates_and_eta():
  stream = io.StringIO()
  bar = progress.Progress(10, label='speculative', stream=stream, log_every_s=0.0)
  bar.update(4, 100)
  bar.update(6, 150)
  bar.close()
  text = stream.getvalue()
  assert '\r' not in text and text.endswith('\n')  # whole lines, readable in a log
  lines = _lines(stream)
  assert len(lines) == 3, lines  # the start, then each update; close repeats nothing
  assert all(line.startswith('speculative:') for line in lines)
  assert '0/10' in lines[0] and '4/10' in lines[1] and '10/10' in lines[2]
  assert re.search(r'\d+\.\d+ex/s', lines[1]) and re.search(r'\d+\.\d+ tok/s', lines[1])
  assert re.search(r'\[\d\d:\d\d<\d\d:\d\d,', lines[1])  # elapsed < ETA
  assert lines[2].count('#') == 28 and lines[1].isascii()


def test_log_lines_are_rate_limited_but_the_end_is_always_shown():
  stream = io.StringIO()
  bar = progress.Progress(10, stream=stream, log_every_s=3600.0)
  for _ in range(9):
    bar.update(1, 3)
  assert len(_lines(stream)) == 1  # only the opening line within the interval
  bar.update(1, 3)
  assert len(_lines(stream)) == 2 and '10/10' in _lines(stream)[-1]  # the total is reached
  bar.close()
  assert len(_lines(stream)) == 2

  stream = io.StringIO()
  bar = progress.Progress(10, stream=stream, log_every_s=3600.0)
  bar.update(3, 3)
  bar.close()  # interrupted: close prints where it stopped
  assert len(_lines(stream)) == 2 and '3/10' in _lines(stream)[-1]


def test_disabled_prints_nothing():
  for stream in (io.StringIO(), _Terminal()):
    bar = progress.Progress(5, initial=1, stream=stream, enabled=False, log_every_s=0.0)
    bar.update(4, 40)
    bar.close()
    assert stream.getvalue() == ''
    assert (bar.done, bar.tokens) == (5, 40)


def test_initial_counts_in_the_total_but_not_in_the_rate(monkeypatch):
  clock = [1000.0]
  monkeypatch.setattr(tqdm.std, 'time', lambda: clock[0])
  stream = io.StringIO()
  bar = progress.Progress(10, initial=6, label='decoding', stream=stream, log_every_s=0.0)
  assert '6/10' in _lines(stream)[0] and '60%' in _lines(stream)[0]
  clock[0] += 4.0
  bar.update(2, 20)
  # 2 new examples and 20 tokens in 4 s; the 6 examples of the earlier run are not in the rate.
  assert '8/10' in _lines(stream)[-1] and bar.done == 8
  assert '0.50ex/s' in _lines(stream)[-1] and '5.0 tok/s' in _lines(stream)[-1]
  assert '00:04<00:04' in _lines(stream)[-1]  # ETA: 2 left at 0.5/s
  bar.close()


def test_a_terminal_redraws_one_line():
  stream = _Terminal()
  bar = progress.Progress(4, stream=stream, log_every_s=3600.0)
  bar.update(4, 8)
  bar.close()
  text = stream.getvalue()
  assert text.startswith('\rdecoding:') and text.endswith('\n') and text.count('\n') == 1
  assert '4/4' in text and 'tok/s' in text


def test_nothing_left_to_do():
  stream = io.StringIO()
  bar = progress.Progress(3, initial=3, stream=stream)
  bar.close()
  assert '3/3' in stream.getvalue()


def test_table():
  assert progress.table([('a', '1'), ('long', '2')], title='t') == (
      't\n' + '-' * 20 + '\na     1\nlong  2')
  assert progress.format_duration(3725) == '1:02:05' and progress.format_duration(
      float('nan')) == '--:--'
