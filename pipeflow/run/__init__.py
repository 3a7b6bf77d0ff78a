"""The run: config schemas and checks, the one builder that makes a run from the config, the
training loop, checkpoints, sweeps and failure handling."""
