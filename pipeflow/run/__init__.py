"""The run: the one builder that makes a run from the config (in phases), the training loop that
runs it, and the guards around it (agreement between ranks, signals, faults, the workspace).
Configuration is :mod:`pipeflow.config`, checkpoints :mod:`pipeflow.checkpoint`."""
