"""flux2: FLUX.2 [klein], its adapter (`adapter.py`) and its tiny random-weight preset (`tiny.py`)."""
