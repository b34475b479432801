"""The acceptance table (issue 27): every numerics choice ranked by the acceptance its drafters reach.
`python -m tools.testbed.table --help`; the parts: config, rows, data, steps, store, report, run, cli."""
