"""One runner per run mode (`cache.py`, `serve.py`) over a run plan (`kvbench/plan.py`),
sharing the data-plane setup and the metric tail (`common.py`)."""
