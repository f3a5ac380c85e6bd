"""The course's own tooling: executing notebooks for the GPU check, the multi-node check, launch timings."""
