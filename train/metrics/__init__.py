"""A run's metrics: the history's file name, shared by its writer (logger.py), its reader (plot.py) and
the run directory's keeper (train/rundir.py, which drops a killed run's records past its checkpoint)."""

METRICS_FILE = "metrics.jsonl"  # in the run directory (--out): one JSON record per log step or event
