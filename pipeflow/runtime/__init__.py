"""The runtime: the transport (batched P2P), the stage (F, B, W) and the interpreter of a lowered
program, the only place where communication meets compute. It never imports planning,
observability or the run; what it measures goes to a recorder (:mod:`pipeflow.runtime.events`)."""
