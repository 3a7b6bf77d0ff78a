"""``python -m pipeflow.plan``: predict the best pipeline layout before running (see
:mod:`pipeflow.run.plan`)."""
from pipeflow.run.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
