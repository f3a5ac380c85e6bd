"""nbval settings for the notebooks: stderr (library warnings) is shown, not compared."""


def pytest_collectstart(collector):
    if hasattr(collector, "skip_compare"):
        collector.skip_compare = tuple(collector.skip_compare) + ("stderr",)
