"""One module per chapter topic: its probes, runs, tables, formulas and figures, built on :mod:`helpers.core`."""
