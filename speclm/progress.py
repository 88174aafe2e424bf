"""A dependency-free progress bar (rate and ETA) and the end-of-job summary table."""

from __future__ import annotations

import sys
import time
from typing import Sequence, TextIO


def format_duration(seconds: float) -> str:
  if seconds != seconds or seconds == float('inf'):  # NaN or inf
    return '--:--'
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f'{hours}:{minutes:02d}:{secs:02d}' if hours else f'{minutes:02d}:{secs:02d}'


class Progress:
  """Examples done out of a total, with examples/s, tokens/s and an ETA.

  On a terminal the bar redraws in place; otherwise (logs, CI) it prints a line at most every
  `log_every_s` seconds and at the end. Examples already done before a resume count in the
  total but not in the rate.
  """

  def __init__(self, total: int, *, initial: int = 0, label: str = 'decoding',
               stream: TextIO | None = None, log_every_s: float = 10.0, width: int = 28,
               enabled: bool = True):
    self.total = total
    self.done = initial
    self._initial = initial
    self.tokens = 0
    self.label = label
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self._tty = hasattr(self.stream, 'isatty') and self.stream.isatty()
    self._log_every_s = log_every_s
    self._width = width
    self._start = time.perf_counter()
    self._last_print = -float('inf')

  def update(self, examples: int, tokens: int = 0) -> None:
    self.done += examples
    self.tokens += tokens
    now = time.perf_counter()
    if self._tty or now - self._last_print >= self._log_every_s or self.done >= self.total:
      self._print(now)

  def line(self, now: float | None = None) -> str:
    now = time.perf_counter() if now is None else now
    elapsed = max(now - self._start, 1e-9)
    new = self.done - self._initial
    rate = new / elapsed
    remaining = self.total - self.done
    eta = remaining / rate if rate > 0 else float('nan')
    fraction = self.done / self.total if self.total else 1.0
    filled = int(round(fraction * self._width))
    bar = '#' * filled + '.' * (self._width - filled)
    return (f'{self.label} [{bar}] {self.done}/{self.total} ex  {rate:.2f} ex/s'
            f'  {self.tokens / elapsed:.1f} tok/s  elapsed {format_duration(elapsed)}'
            f'  ETA {format_duration(eta if remaining else 0)}')

  def _print(self, now: float) -> None:
    self._last_print = now
    if not self.enabled:
      return
    if self._tty:
      self.stream.write('\r' + self.line(now))
    else:
      self.stream.write(self.line(now) + '\n')
    self.stream.flush()

  def close(self) -> None:
    if self.enabled and self._tty:
      self.stream.write('\n')
      self.stream.flush()


def table(rows: Sequence[tuple[str, str]], title: str = '') -> str:
  """A two-column aligned table as text."""
  width = max((len(k) for k, _ in rows), default=0)
  lines = [title, '-' * max(len(title), 20)] if title else []
  lines += [f'{key.ljust(width)}  {value}' for key, value in rows]
  return '\n'.join(lines)
