"""A run directory's saved ``config.yaml`` read as today's config: old key names under their new
ones (:mod:`pipeflow.run.config_renames`), keys added since at their defaults."""
from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeflow.run.config import Config
from pipeflow.run.config_renames import rename_keys

log = logging.getLogger("pipeflow")


def upgrade_saved(cfg: DictConfig, path: str) -> DictConfig:
    """A run's saved ``config.yaml`` (at `path`) under today's key names and on today's schemas
    (a key added since takes its default): a run written before a rename resumes and generates
    as it was (one log line says which keys moved)."""
    done = rename_keys(cfg, where=path, warn=False)
    if done:
        log.info("%s: read under today's key names (%s; docs/reference/renames.md)", path,
                 ", ".join(f"{r.old} -> {r.new}" for r in done))
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:  # a key removed since: read it as it was saved
        log.info("%s: not on today's schemas (%s); read as saved", path, str(exc).splitlines()[0])
        return cfg
