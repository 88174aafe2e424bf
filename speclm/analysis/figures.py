"""PNG figures of the paper's analysis (matplotlib, Agg; no display needed).

  expected_tokens_figure      Fig. 2: E[tokens per iteration] (Eq. 1) vs α for several γ
  optimal_gamma_figure        Fig. 3: the optimal γ vs α for several c
  speed_vs_operations_figure  Fig. 4: walltime improvement vs operations factor
  beta_histogram_figure       the measured distribution of β, with α marked

Figures are built on `matplotlib.figure.Figure` directly (no pyplot global state), and each
function returns the path it wrote.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from speclm.analysis import measure
from speclm.analysis import theory


def _new_figure(width: float = 6.0, height: float = 4.2):
  figure = Figure(figsize=(width, height), dpi=120)
  FigureCanvasAgg(figure)  # attaches the Agg canvas
  return figure, figure.add_subplot(1, 1, 1)


def _save(figure: Figure, path: str) -> str:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  figure.tight_layout()
  figure.savefig(path, format='png')
  return path


def expected_tokens_figure(path: str, gammas: Sequence[int] = (1, 2, 3, 5, 7, 10),
                           oracle: bool = True) -> str:
  """E[tokens per iteration] = (1 − α^(γ+1))/(1 − α) against α, one curve per γ (Fig. 2).

  With `oracle`, also the γ-oracle bound 1/(1 − α) (§3.5).
  """
  figure, axes = _new_figure()
  alphas = np.linspace(0.0, 0.99, 199)
  for gamma in gammas:
    axes.plot(alphas, theory.expected_tokens_per_iteration(alphas, gamma), label=f'γ = {gamma}')
  if oracle:
    bound = theory.oracle_tokens_bound(alphas)
    axes.plot(alphas, bound, 'k--', linewidth=1, label='oracle 1/(1−α)')
    axes.set_ylim(0.9, max(gammas) + 1.5)
  axes.set_xlabel('α (expected acceptance rate)')
  axes.set_ylabel('expected tokens per iteration')
  axes.set_title('Eq. (1): tokens per target call')
  axes.grid(alpha=0.3)
  axes.legend(fontsize=8)
  return _save(figure, path)


def optimal_gamma_figure(path: str, costs: Sequence[float] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
                         r: float = 1.0, max_gamma: int = 64) -> str:
  """The γ maximizing Theorem 3.8's improvement against α, one curve per c (Fig. 3).

  Points where no γ helps (improvement ≤ 1, i.e. α ≤ c for r = 1) are left out.
  """
  figure, axes = _new_figure()
  alphas = np.linspace(0.01, 0.95, 189)
  for c in costs:
    best = [theory.optimal_gamma(a, c, r, max_gamma) for a in alphas]
    gammas = np.array([b.gamma if b.beneficial else np.nan for b in best], dtype=np.float64)
    axes.step(alphas, gammas, where='mid', label=f'c = {c:g}')
  axes.set_yscale('log')
  ticks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100) if t <= max_gamma]
  axes.set_yticks(ticks, [str(t) for t in ticks])
  axes.minorticks_off()
  axes.set_xlabel('α (expected acceptance rate)')
  axes.set_ylabel('optimal γ')
  axes.set_title('Optimal γ (Theorem 3.8' + (')' if r == 1 else f', r = {r:g})'))
  axes.grid(alpha=0.3, which='both')
  axes.legend(fontsize=8)
  return _save(figure, path)


def speed_vs_operations_figure(path: str, alphas: Sequence[float] = (0.5, 0.6, 0.7, 0.8, 0.9),
                               max_gamma: int = 10, c: float = 0.0, c_hat: float = 0.0,
                               r: float = 1.0) -> str:
  """Walltime improvement (Thm 3.8) against operations factor (Thm 3.11) for γ = 1 … max_gamma.

  One curve per α, one marker per γ (Fig. 4); the cells of Table 1 are labelled when c = ĉ = 0.
  """
  figure, axes = _new_figure()
  gammas = np.arange(1, max_gamma + 1)
  for alpha in alphas:
    speed = theory.walltime_improvement(alpha, gammas, c, r)
    operations = theory.operations_factor(alpha, gammas, c_hat)
    axes.plot(operations, speed, marker='o', markersize=3, label=f'α = {alpha:g}')
    for gamma in gammas:
      if c == 0 and c_hat == 0 and r == 1 and (alpha, int(gamma)) in theory.PAPER_TABLE1:
        axes.annotate(f'γ={gamma}', (operations[gamma - 1], speed[gamma - 1]), fontsize=7,
                      xytext=(3, -9), textcoords='offset points')
  axes.set_xlabel('operations factor (Theorem 3.11)')
  axes.set_ylabel('walltime improvement (Theorem 3.8)')
  axes.set_title(f'Speed vs operations (c = {c:g}, ĉ = {c_hat:g}, γ = 1…{max_gamma})')
  axes.grid(alpha=0.3)
  axes.legend(fontsize=8)
  return _save(figure, path)


def beta_histogram_figure(path: str, summary: measure.BetaSummary, title: str = '') -> str:
  """The distribution of β over the measured positions, with α = E[β] marked."""
  figure, axes = _new_figure()
  edges = summary.bin_edges
  fractions = summary.histogram / max(summary.num_positions, 1)
  axes.bar(edges[:-1], fractions, width=np.diff(edges), align='edge', edgecolor='white')
  axes.axvline(summary.alpha, color='k', linestyle='--', linewidth=1,
               label=f'α = {summary.alpha:.3f}')
  axes.set_xlim(0, 1)
  axes.set_xlabel('β = Σ min(p̃, q̃)')
  axes.set_ylabel('fraction of positions')
  axes.set_title(title or f'β over {summary.num_positions} positions')
  axes.legend(fontsize=8)
  return _save(figure, path)


def theory_figures(directory: str) -> list[str]:
  """Figures 2, 3 and 4 with default settings, written into `directory`."""
  return [
      expected_tokens_figure(os.path.join(directory, 'fig2_expected_tokens.png')),
      optimal_gamma_figure(os.path.join(directory, 'fig3_optimal_gamma.png')),
      speed_vs_operations_figure(os.path.join(directory, 'fig4_speed_vs_operations.png')),
  ]
