"""Configuration: the schemas every run and command starts from (registered in Hydra's
ConfigStore), the checks of a composed config, the closed sets of words some keys take, the keys'
old names, and a saved run's config read as today's.  Every value is checked once, at start,
naming the key to fix (:mod:`pipeflow.config.schema`)."""
