"""The Triton glue: everything between tritonserver and the engine.

launcher.py     start/stop the local tritonserver of the nvidia-pytriton wheel
triton_model.py the Python-backend model class (model.py is one import of it)
tensors.py      request tensors -> SamplingParams (validation), outputs -> tensors
sender.py       the one thread that sends responses and polls cancellation
metrics.py      custom Prometheus metrics, applied off the hot path
repository.py   `make repository`: config.pbtxt input/output lists and docs tables from the declarations
openai_api/     the OpenAI Images API front door (its own process; no model code)

Only triton_model.py imports `triton_python_backend_utils`; the rest imports without Triton.
"""
