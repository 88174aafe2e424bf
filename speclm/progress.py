"""The decoding progress bar (tqdm: rate, ETA, tokens/s) and the end-of-job summary table."""

from __future__ import annotations

import sys
from typing import Sequence, TextIO

import tqdm


def format_duration(seconds: float) -> str:
  """`seconds` as MM:SS, or H:MM:SS from an hour; '--:--' for NaN or infinity."""
  if seconds != seconds or seconds == float('inf'):  # NaN or inf
    return '--:--'
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f'{hours}:{minutes:02d}:{secs:02d}' if hours else f'{minutes:02d}:{secs:02d}'


def _interactive(stream) -> bool:
  """A terminal, or a Jupyter kernel's output (which also redraws a line on '\\r')."""
  if hasattr(stream, 'isatty') and stream.isatty():
    return True
  if stream not in (sys.stdout, sys.stderr) or 'ipykernel' not in sys.modules:
    return False
  try:
    return 'IPKernelApp' in sys.modules['IPython'].get_ipython().config
  except Exception:  # pylint: disable=broad-except
    return False


class _LineTqdm(tqdm.tqdm):
  """tqdm that prints each refresh as a whole line, for logs and CI (no '\\r' redraws)."""

  line_n = None  # the count shown by the last printed line

  def display(self, msg=None, pos=None):
    del pos
    msg = self.__str__() if msg is None else msg
    if not msg:  # tqdm clearing the bar: nothing to clear in a log
      return False
    self.fp.write(msg + '\n')
    self.fp.flush()
    self.line_n = self.n
    return True

  def close(self):
    if self.disable:
      return
    if self.line_n != self.n:
      self.refresh()  # a last line with the final count, unless it is already printed
    self.leave = False  # tqdm's own final redraw would repeat that line
    super().close()


class Progress:
  """Examples done out of a total, with examples/s, tokens/s and an ETA (a tqdm bar).

  On a terminal (or in a notebook) the bar redraws in place; otherwise (logs, CI) it prints a
  line at most every `log_every_s` seconds, when the total is reached and at `close()`.
  Examples already done before a resume (`initial`) count in the total but not in the rate.
  """

  def __init__(self, total: int, *, initial: int = 0, label: str = 'decoding',
               stream: TextIO | None = None, log_every_s: float = 10.0, width: int = 28,
               enabled: bool = True):
    self.total = total
    self.label = label
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self.done = initial
    self.tokens = 0
    self._tty = _interactive(self.stream)
    cls = tqdm.tqdm if self._tty else _LineTqdm
    self._bar = cls(
        total=total, initial=initial, desc=label, unit='ex', file=self.stream,
        postfix='0.0 tok/s', disable=not enabled, leave=True, dynamic_ncols=False, position=0,
        bar_format=('{l_bar}{bar:%d}| {n_fmt}/{total_fmt} [{elapsed}<{remaining},'
                    ' {rate_noinv_fmt}{postfix}]' % width),
        # On a terminal redraw often; in a log, at most a line every log_every_s seconds.
        # `miniters=1` checks the clock at every update (tqdm would otherwise adapt it).
        mininterval=0.1 if self._tty else log_every_s, miniters=1,
        # Logs: plain ASCII and the average rate since the start, not a moving average.
        ascii=None if self._tty else True, smoothing=0.3 if self._tty else 0.0)

  def _set_postfix(self) -> None:
    elapsed = self._bar.format_dict['elapsed'] if self.enabled else 0.0
    rate = self.tokens / elapsed if elapsed > 0 else 0.0
    self._bar.set_postfix_str(f'{rate:.1f} tok/s', refresh=False)

  def update(self, n_examples: int, n_tokens: int = 0) -> None:
    """Counts `n_examples` more examples done and `n_tokens` more tokens generated."""
    self.done += n_examples
    self.tokens += n_tokens
    self._set_postfix()
    printed = self._bar.update(n_examples)
    if (not printed and not self._tty and self.enabled and self.done >= self.total
        and self._bar.line_n != self.done):
      self._bar.refresh()  # logs always get the line that says it is finished

  def close(self) -> None:
    """Shows the final rate and closes the bar."""
    self._set_postfix()
    self._bar.close()


def table(rows: Sequence[tuple[str, str]], title: str = '') -> str:
  """A two-column aligned table as text."""
  width = max((len(k) for k, _ in rows), default=0)
  lines = [title, '-' * max(len(title), 20)] if title else []
  lines += [f'{key.ljust(width)}  {value}' for key, value in rows]
  return '\n'.join(lines)
