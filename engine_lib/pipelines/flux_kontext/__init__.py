"""flux_kontext: its adapter (`adapter.py`) and its tiny random-weight preset (`tiny.py`)."""
