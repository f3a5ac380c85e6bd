"""The course's core: what every chapter uses to launch real runs, measure them and read their records.

It imports no topic: a run names a topic's probe, trainer, model builder or task by import path
(:mod:`helpers.core.plan`), and the ranks import it from there.
"""
