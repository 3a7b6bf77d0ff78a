"""A run directory's saved ``config.yaml`` read as today's config: old key names under their new
ones (:mod:`pipeflow.config.renames`), the data keys its source does not take dropped (the
data schema was one union for every source), keys added since at their defaults."""
from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pipeflow.errors import ConfigError
from pipeflow.config.schema import Config
from pipeflow.config.data import data_schema_of
from pipeflow.config.renames import rename_keys

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
        schema = _fit_data(cfg, path)
        return OmegaConf.merge(OmegaConf.structured(Config), {"data": OmegaConf.structured(schema)},  # type: ignore[return-value]
                               cfg)
    except (OmegaConfBaseException, ConfigError) as exc:  # a key removed since, a source gone: read it as saved
        log.info("%s: not on today's schemas (%s); read as saved", path, str(exc).splitlines()[0])
        return cfg


def _fit_data(cfg: DictConfig, path: str) -> Any:
    """The schema of the saved run's data source, its saved ``data`` section cut to that schema's
    keys in place: a run saved when every source carried every source's keys (``data.level`` on
    ``data=markov``) had them at their unused defaults.

    Raises:
        ConfigError: the saved source is unknown (the caller reads the config as saved).
    """
    data = cfg.get("data")
    schema = data_schema_of(data if data is not None else {})
    if not OmegaConf.is_dict(data):
        return schema
    keep = {spec.name for spec in fields(schema)}
    extra = [key for key in data if key not in keep]
    if extra:
        with open_dict(data):
            for key in extra:
                del data[key]
        log.info("%s: data=%s takes no %s; read without them", path, schema.source, ", ".join(extra))
    return schema
