"""speclm: exact speculative decoding (Leviathan, Kalman & Matias, ICML 2023) in JAX."""

from speclm.adaptive import AdaptiveGamma
from speclm.decoding import DecodeResult
from speclm.decoding import DecodeStats
from speclm.decoding import StopReason
from speclm.decoding import autoregressive_decode
from speclm.decoding import speculative_decode
from speclm.protocol import LanguageModel
from speclm.protocol import Model
from speclm.sampling import GREEDY
from speclm.sampling import SamplingConfig

__all__ = [
    'AdaptiveGamma', 'DecodeResult', 'DecodeStats', 'GREEDY', 'LanguageModel', 'Model', 'SamplingConfig',
    'StopReason', 'autoregressive_decode', 'speculative_decode',
]

__version__ = '0.1.0'
