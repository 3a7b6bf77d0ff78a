"""pipeflow: pipeline-parallel training for PyTorch.

The package shows its parts (arrows point down only; errors.py is the base every part uses):

    run/            config schemas and checks, the one builder, the training loop, checkpoints,
                    sweeps, failure handling (train.py and ``python -m pipeflow.plan`` enter here)
    observability/  per-stage figures, TensorBoard, traces, console
    planning/       profiling, partition and balance, the planner and its cost model
    runtime/        the transport, the stage, the interpreter of a lowered program
    schedules/      the IR, pure generators, lowering, the simulator, pictures (no torch.distributed)
    models/         model specs as lazy layer lists, built-in models (they never know they are pipelined)
    data/           batches made locally or read from disk, identical on every rank
"""
