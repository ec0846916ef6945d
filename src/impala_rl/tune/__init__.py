"""``impala tune``: search over config keys (Optuna) and population-based training.

- :mod:`impala_rl.tune.space`: the search space, parsed and checked;
- :mod:`impala_rl.tune.runs`: a trial's training as an ``impala train`` process, watched;
- :mod:`impala_rl.tune.study`: the Optuna study (TPE, median pruning, SQLite storage), on this
  machine or, with ``runner.ray_address``, across a Ray cluster;
- :mod:`impala_rl.tune.pbt`: a population trained side by side with exploit and explore;
- :mod:`impala_rl.tune.report`: the table, the best config, the figures.
"""

from __future__ import annotations

from impala_rl.tune.pbt import Population, PopulationSettings
from impala_rl.tune.space import Param, parse_space
from impala_rl.tune.study import Study, StudySettings

__all__ = ["Param", "Population", "PopulationSettings", "Study", "StudySettings", "parse_space"]
