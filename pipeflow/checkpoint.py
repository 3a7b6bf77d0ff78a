"""``python -m pipeflow.checkpoint``: list, check and export checkpoints (see
:mod:`pipeflow.run.checkpoint`)."""
from pipeflow.run.checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
