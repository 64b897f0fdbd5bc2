"""Running a trial: ``trial.py`` (``run_trial``: each arm on fresh processes), ``launch.py`` (node
processes, forked by ``zygote.py``), ``node.py`` (a trial's node), ``capacity.py`` (checks the
nodes fit first), ``formation.py`` (judges when the overlay has formed).
"""
