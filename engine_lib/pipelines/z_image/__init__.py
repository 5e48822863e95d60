"""z_image: Z-Image and Z-Image-Turbo, its adapter (`adapter.py`) and its tiny random-weight preset (`tiny.py`)."""
