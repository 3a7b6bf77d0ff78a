"""``python -m pipeflow.launch [torchrun options] train.py [overrides]``: torchrun that exits 75
when the job was preempted and finds each node's address on several hosts (see
:mod:`pipeflow.commands.launch`)."""
from pipeflow.commands.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
