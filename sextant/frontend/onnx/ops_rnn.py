"""ONNX recurrent ops: RNN, GRU, LSTM, unrolled over the (static) sequence length."""

from __future__ import annotations
