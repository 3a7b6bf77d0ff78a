"""``python -m pipeflow.plan``: the best layout predicted before running (:mod:`.command`), the
degrees it searches (:mod:`.tp`, :mod:`.cp`, :mod:`.ep`), the layers' profiles, a rehearsal of the
shortlist, and a cluster planned before it is rented (:mod:`.cluster`)."""
