"""``torchrun --nproc-per-node N -m pipeflow.generate [overrides] train.resume=<checkpoint> generate.prompts=<file>``:
text from a trained model on the pipeline (see :mod:`pipeflow.commands.generate`)."""
from pipeflow.commands.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
