"""``python -m pipeflow.checkpoint export [--format pt|hf] [--force] <checkpoint> <out>``: the whole
model of a checkpoint, from any dp/pp/shard layout, under the model's own names (a state dict
for ``load_state_dict``, or a Hugging Face folder for ``from_pretrained``); see
:mod:`pipeflow.checkpoint.exporting`.

``python -m pipeflow.checkpoint gather <parts...> <out>``: one checkpoint from each host's part of
a ``train.checkpoint_storage=local`` checkpoint; see :mod:`pipeflow.checkpoint.gather`."""
from pipeflow.checkpoint.saving import main

if __name__ == "__main__":
    raise SystemExit(main())
