"""Observability: events recorded during a step, per-stage figures, TensorBoard, traces, console."""
