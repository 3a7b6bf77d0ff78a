"""The commands: ``python -m pipeflow.plan``, ``.launch`` and ``.generate`` and ``train.py -m``
sweeps, each a thin entry point over the parts (configuration, the run, planning, checkpoints).
``python -m pipeflow.checkpoint`` lives with the checkpoints it reads."""
