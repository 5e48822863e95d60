"""The Triton glue: everything between tritonserver and the engine.

serve.py        the launcher's CLI (`serve`, `ready`): tritonserver supervised, the gate and front door beside it
tritonserver.py start/stop one local tritonserver (`TritonServer`)
wheel.py        the nvidia-pytriton wheel's tritonserver laid out to run (backend dir, environment)
processes.py    the launcher's children (`ChildProcess`: gate, front door), spawn, the reaper, group signals
supervisor.py   restart a tritonserver or stub that dies, or a server that stops answering
grpc_gate.py    the public gRPC port in front of tritonserver's (its own process)
triton_model.py the Python-backend model class (model.py is one import of it)
tensors.py      request tensors -> SamplingParams (validation), outputs -> tensors
sender.py       the one thread that sends responses and polls cancellation
parameters.py   request parameters (`priority_key`): who may jump the queue
mp4.py          video (and its sound) as an mp4 file in memory
metrics.py      custom Prometheus metrics, applied off the hot path
repository.py   `make repository`: config.pbtxt input/output lists and docs tables from the declarations
openai_api/     the OpenAI Images API front door (its own process; no model code)

Only triton_model.py imports `triton_python_backend_utils`; the rest imports without Triton.
"""
