"""``python -m pipeflow.plan``: predict the best pipeline layout before running (see
:mod:`pipeflow.commands.plan.command`)."""
from pipeflow.commands.plan.command import main

if __name__ == "__main__":
    raise SystemExit(main())
